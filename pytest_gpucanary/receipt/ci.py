"""Who ran the gate: the CI job's identity from its environment variables (GitHub, GitLab, Jenkins)."""

from __future__ import annotations

from collections.abc import Callable, Mapping


def _github(env: Mapping[str, str]) -> dict[str, str]:
    if not env.get("GITHUB_RUN_ID"):
        return {}
    ids = {
        "provider": "github",
        "repository": env.get("GITHUB_REPOSITORY", ""),
        "run_id": env["GITHUB_RUN_ID"],
        "job": env.get("GITHUB_JOB", ""),
    }
    if ids["repository"]:
        server = env.get("GITHUB_SERVER_URL", "https://github.com").rstrip("/")
        ids["url"] = f"{server}/{ids['repository']}/actions/runs/{ids['run_id']}"
    return ids


def _gitlab(env: Mapping[str, str]) -> dict[str, str]:
    if not env.get("CI_JOB_ID"):
        return {}
    return {
        "provider": "gitlab",
        "project": env.get("CI_PROJECT_PATH", ""),
        "job_id": env["CI_JOB_ID"],
        "pipeline_id": env.get("CI_PIPELINE_ID", ""),
        "url": env.get("CI_JOB_URL", ""),
    }


def _jenkins(env: Mapping[str, str]) -> dict[str, str]:
    if not (env.get("BUILD_NUMBER") and env.get("JOB_NAME")):
        return {}
    return {
        "provider": "jenkins",
        "job": env["JOB_NAME"],
        "build_number": env["BUILD_NUMBER"],
        "url": env.get("BUILD_URL", ""),
    }


CI_PROVIDERS: tuple[Callable[[Mapping[str, str]], dict[str, str]], ...] = (_github, _gitlab, _jenkins)


def ci_identity(environ: Mapping[str, str]) -> dict[str, str]:
    """Who ran the gate: the first CI whose variables are set; empty values left out; {} outside CI."""
    for provider in CI_PROVIDERS:
        if ids := provider(environ):
            return {k: v for k, v in ids.items() if v}
    return {}
