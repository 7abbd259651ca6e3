"""The CI templates users copy: checked by the tools each CI would apply, plus what those tools miss.

GitHub: actionlint (built by ci/build-actionlint.sh, with shellcheck on every run: script).
GitLab: the YAML parsed, its jobs' keys and scripts checked, the scripts shellchecked.
Jenkins: no offline Jenkins linter exists; the Jenkinsfiles are compiled by groovyc (syntax), their
sh scripts are shellchecked, and the declarative structure is read from the source.
All: the credential only where a reviewer let it, and time-outs that cover a run's worst case.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from pytest_gpucanary.config import Settings
from pytest_gpucanary.shipped import REPO_ROOT

TEMPLATES = REPO_ROOT / "ci" / "templates"
GITHUB = TEMPLATES / "github-actions.yaml"
GITLAB = TEMPLATES / "gitlab-ci.yaml"
JENKINS = TEMPLATES / "Jenkinsfile"
VERSION = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: `make setup` (ci/install-deps.sh) installs it"
    return path


def shellcheck(script: str, *, shell: str) -> str:
    result = subprocess.run([tool("shellcheck"), f"--shell={shell}", "-"], input=script, capture_output=True,
                            text=True, timeout=60)
    return result.stdout if result.returncode else ""


# --- GitHub Actions ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def actionlint() -> str:
    result = subprocess.run(["bash", str(REPO_ROOT / "ci" / "build-actionlint.sh")], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def run_actionlint(actionlint: str, workflow: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "actionlint.yaml"   # the template's self-hosted runner label
    config.write_text("self-hosted-runner:\n  labels: [gpu-cluster-access]\n")
    return subprocess.run([actionlint, "-config-file", str(config), f"-shellcheck={tool('shellcheck')}",
                           "-no-color", str(workflow)], capture_output=True, text=True, timeout=120)


def github(path: Path = GITHUB) -> dict:
    workflow = yaml.safe_load(path.read_text())
    workflow["on"] = workflow.pop(True, workflow.get("on"))   # YAML 1.1 reads the key `on` as true
    return workflow


def steps() -> list[dict]:
    return github()["jobs"]["canary"]["steps"]


def step(name_part: str) -> dict:
    [found] = [s for s in steps() if name_part in s.get("name", "")]
    return found


def test_actionlint_here_does_catch_an_injectable_run_script(actionlint: str, tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(GITHUB.read_text().replace(
        '"$RUNNER_TEMP/gpucanary/venv/bin/gpucanary" lint "$CANARY_POLICY"',
        '"$RUNNER_TEMP/gpucanary/venv/bin/gpucanary" lint ${{ github.event.pull_request.title }}'))
    result = run_actionlint(actionlint, broken, tmp_path)
    assert result.returncode == 1 and "potentially untrusted" in result.stdout, result.stdout


def test_no_expression_is_interpolated_into_a_run_script() -> None:
    scripts = [s["run"] for s in steps() if "run" in s]
    assert len(scripts) == 6
    assert [s for s in scripts if "${{" in s] == []


def test_github_least_permissions_and_one_canary_per_cluster() -> None:
    workflow = github()
    assert workflow["permissions"] == {"contents": "read"}
    job = workflow["jobs"]["canary"]
    assert "permissions" not in job
    assert job["concurrency"] == {"group": "gpucanary-${{ vars.CANARY_CLUSTER || 'default' }}",
                                  "cancel-in-progress": False}
    checkout = steps()[0]
    assert checkout["uses"].startswith("actions/checkout@") and checkout["with"] == {"persist-credentials": False}


def test_actions_are_pinned_to_commits() -> None:
    uses = [s["uses"] for s in steps() if "uses" in s]
    assert [u.split("@")[0] for u in uses] == ["actions/checkout", "actions/upload-artifact"]
    assert all(re.fullmatch(r"[0-9a-f]{40}", u.split("@")[1]) for u in uses), uses


def test_github_run_id_reaches_the_gate_and_the_cleanup() -> None:
    env = github()["jobs"]["canary"]["env"]
    assert env["CANARY_RUN_ID"] == "gh-${{ github.run_id }}-${{ github.run_attempt }}"
    assert '--gpucanary-run-id="$CANARY_RUN_ID"' in step("Canary gate")["run"]
    assert '--run-id "$CANARY_RUN_ID"' in step("Clean up")["run"]


def test_github_kubeconfig_comes_from_a_secret_through_env_into_a_mode_600_file() -> None:
    kubeconfig = step("kubeconfig")
    assert kubeconfig["env"] == {"KUBECONFIG_DATA": "${{ secrets.CANARY_KUBECONFIG }}"}
    assert kubeconfig["run"].splitlines()[0] == "umask 077"


def test_github_publishes_junit_once_then_summary_and_artifact_before_cleanup() -> None:
    names = [s.get("name", s.get("uses", "")) for s in steps()]
    summary, upload, cleanup = (names.index(step(n)["name"]) for n in ("job summary", "Upload", "Clean up"))
    assert summary < cleanup and upload < cleanup and cleanup == len(names) - 1
    assert step("job summary")["if"] == "always()" and step("Upload")["if"] == "always()"
    assert step("Clean up")["if"] == "always() && steps.kubeconfig.outcome == 'success'"
    assert 'receipt="reports/$CANARY_RUN_ID/receipt.md"' in step("job summary")["run"]
    assert '>> "$GITHUB_STEP_SUMMARY"' in step("job summary")["run"]
    assert step("Upload")["with"]["path"] == "reports/"
    text = "\n".join(s.get("run", "") for s in steps())
    assert text.count("--junitxml=") == 1 and "--junitxml=reports/junit.xml" in text
    assert "stages.junit.xml" not in text


# --- all three: the pinned release into a virtualenv ----------------------------------------------------

def test_every_template_pins_this_release_and_installs_it_into_a_virtualenv() -> None:
    gitlab_job = yaml.safe_load(GITLAB.read_text())["gpu-driver-canary"]
    assert github()["jobs"]["canary"]["env"]["GPUCANARY_VERSION"] == VERSION
    assert gitlab_job["variables"]["GPUCANARY_VERSION"] == VERSION
    assert f"GPUCANARY_VERSION = '{VERSION}'" in JENKINS.read_text()
    for template in (GITHUB, GITLAB, JENKINS):
        text = template.read_text()
        assert "python3 -m venv" in text, template.name
        assert '"pytest-gpucanary @ $GPUCANARY_FROM@v$GPUCANARY_VERSION"' in text, template.name   # git tag
        assert '"pytest-gpucanary==$GPUCANARY_VERSION"' in text, template.name                     # PyPI
        assert '--find-links "$GPUCANARY_FROM"' in text, template.name                             # wheels
        assert not re.search(r"^\s*(- )?(run: )?pip install", text, re.MULTILINE), template.name


# --- GitLab CI -----------------------------------------------------------------------------------------

GITLAB_JOB_KEYWORDS = {  # the job keywords of the .gitlab-ci.yml reference
    "after_script", "allow_failure", "artifacts", "before_script", "cache", "coverage", "dast_configuration",
    "dependencies", "environment", "extends", "hooks", "identity", "id_tokens", "image", "inherit", "interruptible",
    "manual_confirmation", "needs", "pages", "parallel", "release", "resource_group", "retry", "rules", "run",
    "script", "secrets", "services", "stage", "tags", "timeout", "trigger", "when", "variables"}


def gitlab_jobs(path: Path = GITLAB) -> dict[str, dict]:
    return yaml.safe_load(path.read_text())


@pytest.fixture
def gitlab_job() -> dict:
    assert list(gitlab_jobs()) == ["gpu-driver-canary", "gpu-driver-canary-cleanup"]
    return gitlab_jobs()["gpu-driver-canary"]


@pytest.fixture
def gitlab_cleanup() -> dict:
    return gitlab_jobs()["gpu-driver-canary-cleanup"]


def test_gitlab_job_uses_only_gitlab_keywords() -> None:
    for template in (GITLAB, GITLAB_GATE):
        for name, job in gitlab_jobs(template).items():
            assert set(job) <= GITLAB_JOB_KEYWORDS, (name, set(job) - GITLAB_JOB_KEYWORDS)
            assert "after_script" not in job, name   # GitLab stops after_script after 5 minutes
            assert all(isinstance(line, str) for line in job["script"]), name


def test_gitlab_one_canary_per_cluster_and_the_job_id_as_run_id(gitlab_job: dict, gitlab_cleanup: dict) -> None:
    assert gitlab_job["resource_group"] == gitlab_cleanup["resource_group"] == "gpucanary-$CANARY_CLUSTER"
    assert gitlab_job["variables"]["CANARY_RUN_ID"] == "gl-$CI_JOB_ID"
    assert '--gpucanary-run-id="$CANARY_RUN_ID"' in gitlab_job["script"][-1]
    # the cleanup job cannot know the canary job's id: it takes every run whose Lease stopped renewing
    assert gitlab_cleanup["script"][-1] == '"$CANARY_VENV/bin/gpucanary" cleanup --kubeconfig "$CANARY_KUBECONFIG"'


def test_gitlab_cleanup_is_a_later_job_that_runs_whatever_the_canary_job_did() -> None:
    for template, (canary, cleanup) in ((GITLAB, ("gpu-driver-canary", "gpu-driver-canary-cleanup")),
                                        (GITLAB_GATE, ("gpu-policy-gate", "gpu-policy-gate-cleanup"))):
        jobs = gitlab_jobs(template)
        assert list(jobs) == [canary, cleanup], template.name
        assert jobs[canary]["stage"] == "test" and jobs[cleanup]["stage"] == ".post"
        assert jobs[cleanup]["rules"] == [{**rule, "when": "always"} for rule in jobs[canary]["rules"]]
        assert jobs[cleanup]["variables"] == jobs[canary]["variables"]
        assert jobs[cleanup]["script"][0] == jobs[canary]["script"][0]   # the same install
        assert jobs[cleanup]["dependencies"] == []
        assert "gpucanary\" cleanup" not in "\n".join(jobs[canary]["script"])


def test_gitlab_kubeconfig_must_be_a_file_variable_made_mode_600(gitlab_job: dict, gitlab_cleanup: dict) -> None:
    for job in (gitlab_job, gitlab_cleanup):
        first = job["script"][0].splitlines()
        assert first[0].startswith('test -f "${CANARY_KUBECONFIG:-}" ||') and "File-type" in first[0]
        assert first[1] == 'chmod 600 "$CANARY_KUBECONFIG"'
        assert "CANARY_KUBECONFIG" not in job["variables"]   # a project variable, never in the file


def test_gitlab_publishes_pytest_junit_once_and_the_reports_always(gitlab_job: dict) -> None:
    artifacts = gitlab_job["artifacts"]
    assert artifacts["when"] == "always" and artifacts["paths"] == ["reports/"]
    assert artifacts["reports"] == {"junit": "reports/junit.xml"}
    assert "--junitxml=reports/junit.xml" in gitlab_job["script"][-1]


def test_gitlab_scripts_pass_shellcheck() -> None:
    for name, job in gitlab_jobs().items():   # a shell runner runs a job's script lines in one bash
        script = "#!/bin/bash\nset -eo pipefail\n" + "\n".join(job["script"]) + "\n"
        assert shellcheck(script, shell="bash") == "", name


# --- Jenkins -------------------------------------------------------------------------------------------

def masked(source: str) -> str:
    """The Groovy source with comments and string contents blanked (lengths kept), quotes left."""
    out, i = [], 0
    pattern = re.compile(r"//[^\n]*|/\*.*?\*/|'''.*?'''|\"\"\".*?\"\"\"|'(?:\\.|[^'\\\n])*'|\"(?:\\.|[^\"\\\n])*\"",
                         re.DOTALL)
    for match in pattern.finditer(source):
        out.append(source[i:match.start()])
        token = match.group()
        if token.startswith("/"):
            out.append(re.sub(r"[^\n]", " ", token))
        else:
            quote = token[:3] if token[:3] in ("'''", '"""') else token[0]
            out.append(quote + re.sub(r"[^\n]", " ", token[len(quote):-len(quote)]) + quote)
        i = match.end()
    out.append(source[i:])
    return "".join(out)


def block(code: str, name: str, start: int = 0, end: int | None = None) -> tuple[int, int]:
    """(start, end) of the body of the first `name {` or `name(...) {` block within code[start:end]."""
    match = re.compile(rf"\b{name}\s*(\([^)]*\))?\s*\{{").search(code, start, end if end is not None else len(code))
    assert match, f"no {name} {{ }} block"
    depth, i = 1, match.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(code[i], 0)
        i += 1
    return match.end(), i - 1


@pytest.fixture(scope="module")
def jenkins() -> tuple[str, str]:
    source = JENKINS.read_text()
    return source, masked(source)


@pytest.mark.parametrize("template", ["Jenkinsfile", "Jenkinsfile.gate"])
def test_jenkinsfile_compiles_as_groovy(tmp_path: Path, template: str) -> None:
    source = (TEMPLATES / template).read_text()
    env = dict(os.environ)
    if not Path("/usr/lib/jvm/default-java/bin/java").exists():   # Debian's groovyc looks there first
        env["JAVA_HOME"] = str(Path(os.path.realpath(tool("java"))).parents[1])
    (tmp_path / "Jenkinsfile.groovy").write_text(source)
    result = subprocess.run([tool("groovyc"), "-d", str(tmp_path / "classes"), "Jenkinsfile.groovy"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    (tmp_path / "Broken.groovy").write_text(source.rsplit("}", 1)[0])   # and it does catch a missing brace
    broken = subprocess.run([tool("groovyc"), "-d", str(tmp_path / "classes"), "Broken.groovy"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=180, env=env)
    assert broken.returncode != 0


def test_jenkins_one_canary_per_cluster(jenkins: tuple[str, str]) -> None:
    source, code = jenkins
    pipeline = block(code, "pipeline")
    options = block(code, "options", *pipeline)
    assert re.search(r"\block\(resource: '[^']+'\)", source[slice(*options)])
    assert "disableConcurrentBuilds()" in code[slice(*options)]


def test_jenkins_post_always_publishes_before_cleanup(jenkins: tuple[str, str]) -> None:
    source, code = jenkins
    stage = block(code, "stage", *block(code, "stages"))
    always = block(code, "always", *block(code, "post", *stage))
    body = source[slice(*always)]
    junit, archive, cleanup = (body.index(word) for word in ("junit ", "archiveArtifacts ", "gpucanary\" cleanup"))
    assert junit < archive < cleanup
    assert len(re.findall(r"\bjunit\b", code)) == 1   # one junit step in the whole file, comments aside
    assert "junit testResults: 'reports/junit.xml', allowEmptyResults: true" in body
    assert "archiveArtifacts artifacts: 'reports/**', allowEmptyArchive: true" in body
    assert '--run-id "$CANARY_RUN_ID"' in body


# `sh '...'`, `sh runId + '...'` and `sh(returnStdout: true, script: '...')`
SH_STEP = r"\bsh(?:\s+|\s*\((?:\w+:\s*\w+,\s*)*script:\s*)(runId \+ )?(?:'''(.*?)'''|'([^'\n]*)')"
DOUBLE_QUOTED_SH = r"\bsh\s*\(?\s*(?:\w+:\s*\w+,\s*)*(?:script:\s*)?(runId \+ )?\""


def sh_scripts(source: str) -> list[str]:
    """Every sh step's script as the shell receives it (Groovy single-quoted strings, runId resolved)."""
    [run_id] = re.findall(r"^def runId = '(.*)'$", source, re.MULTILINE)
    scripts = []
    for prefix, triple, single in re.findall(SH_STEP, source, re.DOTALL):
        text = (triple or single).replace("\\\\", "\\")
        scripts.append((run_id.replace("\\n", "\n") if prefix else "") + text)
    return scripts


def test_jenkins_sh_scripts_are_single_quoted_and_pass_shellcheck(jenkins: tuple[str, str]) -> None:
    source, code = jenkins
    assert len(re.findall(r"\bsh\b", code)) == 4
    assert not re.search(DOUBLE_QUOTED_SH, code)   # no Groovy-interpolated (double-quoted) script
    scripts = sh_scripts(source)
    assert len(scripts) == 4
    for script in scripts:
        shell = "bash" if script.startswith("#!/bin/bash") else "sh"
        assert shellcheck(script if shell == "bash" else "#!/bin/sh\n" + script, shell=shell) == "", script


def test_jenkins_run_id_reaches_the_gate_and_the_cleanup(jenkins: tuple[str, str]) -> None:
    scripts = sh_scripts(jenkins[0])
    gate = next(s for s in scripts if "gpucanary\" run" in s)
    cleanup = next(s for s in scripts if "gpucanary\" cleanup" in s)
    for script in (gate, cleanup):
        assert script.startswith('CANARY_RUN_ID="jk-$BUILD_NUMBER-$(printf %s "$JOB_NAME" | sha256sum | cut -c1-10)"\n')
    assert '--gpucanary-run-id="$CANARY_RUN_ID"' in gate and "--junitxml=reports/junit.xml" in gate
    result = subprocess.run(["sh", "-c", gate.splitlines()[0] + '\necho "$CANARY_RUN_ID"'], capture_output=True,
                            text=True, env={"PATH": os.environ["PATH"], "BUILD_NUMBER": "42",
                                            "JOB_NAME": "gpu/Canary Folder/main"}, timeout=30)
    assert re.fullmatch(r"jk-42-[0-9a-f]{10}\n", result.stdout)   # a DNS label and a label value


# --- the pre-merge policy gate (base vs head) ------------------------------------------------------------

GITHUB_GATE = TEMPLATES / "github-actions-gate.yaml"
GITLAB_GATE = TEMPLATES / "gitlab-ci-gate.yaml"
JENKINS_GATE = TEMPLATES / "Jenkinsfile.gate"


def test_github_gate_runs_on_policy_prs_with_the_base_branch_file_through_env_only() -> None:
    workflow = yaml.safe_load(GITHUB_GATE.read_text())
    workflow["on"] = workflow.pop(True, workflow.get("on"))
    assert workflow["on"] == {"pull_request": {"paths": ["gpu-operator/upgrade-policy.yaml"]}}
    assert workflow["permissions"] == {"contents": "read"}          # job summary, no PR comment
    job = workflow["jobs"]["gate"]
    assert job["env"]["CANARY_BASE"] == "git:origin/${{ github.base_ref }}:gpu-operator/upgrade-policy.yaml"
    assert job["env"]["GPUCANARY_VERSION"] == VERSION
    scripts = [s["run"] for s in job["steps"] if "run" in s]
    assert [s for s in scripts if "${{" in s] == []
    gate = next(s for s in scripts if " gate " in s)
    assert '--base "$CANARY_BASE" --head "$CANARY_POLICY"' in gate and '--gpucanary-run-id="$CANARY_RUN_ID"' in gate
    assert any('gate-$CANARY_RUN_ID/gate.md' in s and "$GITHUB_STEP_SUMMARY" in s for s in scripts)
    assert '--run-id "$CANARY_RUN_ID-$side" || rc=$?' in scripts[-1]   # both sides, even when one fails
    assert job["steps"][0]["with"] == {"persist-credentials": False, "fetch-depth": 0}
    uses = [s["uses"] for s in job["steps"] if "uses" in s]
    assert all(re.fullmatch(r"[0-9a-f]{40}", u.split("@")[1]) for u in uses), uses


def test_gitlab_gate_runs_on_policy_merge_requests_and_its_scripts_pass_shellcheck() -> None:
    document = gitlab_jobs(GITLAB_GATE)
    assert list(document) == ["gpu-policy-gate", "gpu-policy-gate-cleanup"]
    job, cleanup = document["gpu-policy-gate"], document["gpu-policy-gate-cleanup"]
    assert set(job) <= GITLAB_JOB_KEYWORDS and job["variables"]["GPUCANARY_VERSION"] == VERSION
    assert job["rules"] == [{"if": '$CI_PIPELINE_SOURCE == "merge_request_event"',
                             "changes": ["gpu-operator/upgrade-policy.yaml"]}]
    script = "\n".join(job["script"])
    assert '--base "git:origin/$CI_MERGE_REQUEST_TARGET_BRANCH_NAME:$CANARY_POLICY" --head "$CANARY_POLICY"' in script
    # both runs (<id>-base, <id>-head) are among the dead runs a cleanup without --run-id takes
    assert cleanup["script"][-1] == '"$CANARY_VENV/bin/gpucanary" cleanup --kubeconfig "$CANARY_KUBECONFIG"'
    for name, each in document.items():
        text = "#!/bin/bash\nset -eo pipefail\n" + "\n".join(each["script"]) + "\n"
        assert shellcheck(text, shell="bash") == "", name


def test_jenkins_gate_runs_on_change_requests_and_its_sh_scripts_pass_shellcheck(tmp_path: Path) -> None:
    source = JENKINS_GATE.read_text()
    code = masked(source)
    assert not re.search(DOUBLE_QUOTED_SH, code)
    assert len(re.findall(r"\bsh\b", code)) == 4
    scripts = sh_scripts(source)
    assert len(scripts) == 4
    for script in scripts:
        shell = "bash" if script.startswith("#!/bin/bash") else "sh"
        assert shellcheck(script if shell == "bash" else "#!/bin/sh\n" + script, shell=shell) == "", script
    gate = next(s for s in scripts if 'gpucanary" gate' in s)
    assert "--base base-policy.yaml --head head-policy.yaml" in gate and '--gpucanary-run-id="$CANARY_RUN_ID"' in gate
    cleanup = next(s for s in scripts if 'gpucanary" cleanup' in s)
    assert '--run-id "$CANARY_RUN_ID-$side" || rc=$?' in cleanup   # both sides, even when one fails
    assert f"GPUCANARY_VERSION = '{VERSION}'" in source


def test_jenkins_gate_reads_the_change_as_data_and_runs_outside_its_checkout() -> None:
    source = JENKINS_GATE.read_text()
    [install] = [s for s in sh_scripts(source) if "python3 -m venv" in s]
    lines = [line.strip() for line in install.splitlines()]
    assert 'git show "origin/$CHANGE_TARGET:$CANARY_POLICY" > "$CANARY_DIR/base-policy.yaml"' in lines
    assert 'git show "HEAD:$CANARY_POLICY" > "$CANARY_DIR/head-policy.yaml"' in lines
    assert lines.index('cd "$CANARY_DIR"') < lines.index('python3 -m venv "$CANARY_VENV"')
    assert "CANARY_DIR = \"${env.WORKSPACE_TMP}/gpucanary\"" in source
    assert "CANARY_VENV = \"${env.WORKSPACE_TMP}/gpucanary/venv\"" in source
    gate = next(s for s in sh_scripts(source) if 'gpucanary" gate' in s)
    first = [line.strip() for line in gate.splitlines()[1:] if line.strip()][0]
    assert first == 'cd "$CANARY_DIR" || exit 4'   # after the run id, before anything runs
    assert '--gpucanary-reports-dir="$WORKSPACE/reports"' in gate   # archived from the workspace


# --- the credential: only where a reviewer let it ----------------------------------------------------------

def test_every_github_job_that_reads_the_kubeconfig_is_in_the_gpu_canary_environment() -> None:
    for template in (GITHUB, GITHUB_GATE):
        workflow = github(template)
        assert workflow["permissions"] == {"contents": "read"}, template.name
        assert "pull_request_target" not in workflow["on"], template.name
        readers = {name: job for name, job in workflow["jobs"].items() if "secrets.CANARY_KUBECONFIG" in str(job)}
        assert readers, template.name
        for name, job in readers.items():
            environment = job.get("environment") or {}
            name_of = environment if isinstance(environment, str) else environment.get("name")
            assert name_of == "gpu-canary", (template.name, name)
            checkout = job["steps"][0]
            assert checkout["uses"].startswith("actions/checkout@") and checkout["with"]["persist-credentials"] is False


def test_every_gitlab_job_that_reads_the_kubeconfig_is_in_the_gpu_canary_environment() -> None:
    for template in (GITLAB, GITLAB_GATE):
        jobs = gitlab_jobs(template)
        readers = {name: job for name, job in jobs.items() if "CANARY_KUBECONFIG" in "\n".join(job["script"])}
        assert list(readers) == list(jobs), template.name
        for name, job in readers.items():
            environment = job.get("environment") or {}
            assert environment.get("name") == "gpu-canary", (template.name, name)
            assert environment.get("action") != "prepare", (template.name, name)   # it would skip the approval
        canary, cleanup = readers.values()
        # the canary is a deployment to the protected environment: it waits for the maintainers' approval
        assert canary["environment"] == {"name": "gpu-canary", "action": "start"}
        assert cleanup["environment"] == {"name": "gpu-canary", "action": "access"}


def test_no_gitlab_template_claims_the_credential_is_a_protected_variable() -> None:
    """Protected variables never reach merge-request pipelines: the credential is scoped to the environment."""
    allowed = ("protected environment", "not marked protected", "never see protected ones",
               "protected variables never reach merge-request pipelines")
    for template in (GITLAB, GITLAB_GATE):
        text = " ".join(template.read_text().replace("#", " ").lower().split())   # comments joined across lines
        claims = text
        for phrase in allowed:
            claims = claims.replace(phrase, "")
        assert "protected" not in claims, (template.name, claims[max(claims.find("protected") - 80, 0):][:160])
        assert "scoped to environment gpu-canary" in text and "not marked protected" in text, template.name


def test_jenkins_templates_are_loaded_from_the_trusted_branch() -> None:
    for template in (JENKINS, JENKINS_GATE):
        source = template.read_text()
        header = " ".join(line.lstrip("/ ") for line in source.splitlines() if line.startswith("//"))
        assert '"Pipeline script from SCM" on the protected main branch' in header, template.name
        assert "Jenkinsfile source is the trusted branch" in header, template.name


def test_jenkins_gate_diffs_against_the_target_branch_not_the_previous_build() -> None:
    for template in (JENKINS, JENKINS_GATE):   # a changeset condition compares with the previous build
        assert "changeset" not in masked(template.read_text()), template.name
    source = JENKINS_GATE.read_text()
    code = masked(source)
    change = block(code, "stage")                 # the first stage: the policy changed against the target?
    gate = block(code, "stage", change[1])        # the second: the canary runs, only when it did
    assert "when { expression { (env.CHANGE_TARGET ?: '') != '' } }" in source[slice(*change)]
    assert "when { environment name: 'CANARY_POLICY_CHANGED', value: 'yes' }" in source[slice(*gate)]
    assert "env.CANARY_POLICY_CHANGED = changed ? 'yes' : 'no'" in source[slice(*change)]
    [detect] = [s for s in sh_scripts(source) if "git diff" in s]
    lines = [line.strip() for line in detect.splitlines() if line.strip()]
    assert lines == ['git fetch --no-tags origin "+refs/heads/$CHANGE_TARGET:refs/remotes/origin/$CHANGE_TARGET" >&2',
                     'git diff --name-only "origin/$CHANGE_TARGET...HEAD" -- "$CANARY_POLICY"']
    assert "sh(returnStdout: true, script:" in source[slice(*change)]
    # a change request that leaves the policy alone passes, saying so
    assert "echo 'This change request does not change gpu-operator/upgrade-policy.yaml:" in source[slice(*change)]


# --- time-outs that cover the worst case ----------------------------------------------------------------

def worst_case_min(runs: int) -> tuple[float, float]:
    """(the runs', their cleanups') worst case in minutes with default options: a cleanup waits for the
    driver up to one upgrade budget."""
    settings = Settings()
    return runs * settings.longest_run_s() / 60, runs * settings.upgrade_budget_s / 60


def gitlab_minutes(timeout: str) -> int:
    match = re.fullmatch(r"(?:(\d+)h)?\s*(?:(\d+)m)?", timeout.strip())
    assert match and any(match.groups()), timeout
    return int(match.group(1) or 0) * 60 + int(match.group(2) or 0)


def jenkins_timeouts(source: str) -> dict[str, int]:
    """Minutes of each timeout(...) { } block by what it wraps: the canary run(s) or the cleanup."""
    code, found = masked(source), {}
    for match in re.finditer(r"\btimeout\(time: (\d+), unit: '\s*'\)\s*\{", code):
        assert source[match.start():match.end()].endswith("unit: 'MINUTES') {"), match.group()
        body = source[slice(*block(code, "timeout", match.start()))]
        kind = ("cleanup" if 'gpucanary" cleanup' in body
                else "run" if re.search(r'gpucanary" (run|gate)', body) else "?")
        assert kind not in found, kind
        found[kind] = int(match.group(1))
    return found


@pytest.mark.parametrize("template, runs", [(GITHUB, 1), (GITHUB_GATE, 2)], ids=["run", "gate"])
def test_github_time_outs_cover_the_worst_case(template: Path, runs: int) -> None:
    run_min, cleanup_min = worst_case_min(runs)
    [job] = github(template)["jobs"].values()
    [step] = [s for s in job["steps"] if re.search(r'gpucanary" (run|gate) ', s.get("run", ""))]
    assert job["timeout-minutes"] >= run_min + cleanup_min, (job["timeout-minutes"], run_min + cleanup_min)
    assert step["timeout-minutes"] >= run_min
    assert job["timeout-minutes"] - step["timeout-minutes"] >= cleanup_min   # the cleanup keeps its time


@pytest.mark.parametrize("template, runs", [(GITLAB, 1), (GITLAB_GATE, 2)], ids=["run", "gate"])
def test_gitlab_time_outs_cover_the_worst_case(template: Path, runs: int) -> None:
    run_min, cleanup_min = worst_case_min(runs)
    minutes = [gitlab_minutes(job["timeout"]) for job in gitlab_jobs(template).values()]
    assert sum(minutes) >= run_min + cleanup_min, (minutes, run_min + cleanup_min)
    canary, cleanup = minutes   # the cleanup is a job of its own, with its own time-out
    assert canary >= run_min and cleanup >= cleanup_min


@pytest.mark.parametrize("template, runs", [(JENKINS, 1), (JENKINS_GATE, 2)], ids=["run", "gate"])
def test_jenkins_time_outs_cover_the_worst_case(template: Path, runs: int) -> None:
    run_min, cleanup_min = worst_case_min(runs)
    timeouts = jenkins_timeouts(template.read_text())
    assert sum(timeouts.values()) >= run_min + cleanup_min, (timeouts, run_min + cleanup_min)
    assert set(timeouts) == {"run", "cleanup"}
    assert timeouts["run"] >= run_min and timeouts["cleanup"] >= cleanup_min


def commands(script: str, verb: str) -> list[dict[str, str]]:
    """Each `gpucanary VERB` command line in a shell script (continuation lines joined): its options."""
    joined = re.sub(r"\\\n\s*", " ", script)
    return [dict(re.findall(r'--(gpucanary-[a-z-]+|head)[= ]("[^"]*"|\S+)', line[line.index(f'gpucanary" {verb}'):]))
            for line in joined.splitlines() if f'gpucanary" {verb} ' in line]


def run_scripts() -> dict[str, str]:
    """Each template's shell text that runs the canary (preflight first), as its shell receives it."""
    found = {}
    for template in (GITHUB, GITHUB_GATE):
        [job] = github(template)["jobs"].values()
        found[template.name] = "\n".join(s["run"] for s in job["steps"] if "run" in s)
    for template in (GITLAB, GITLAB_GATE):
        found[template.name] = "\n".join(next(iter(gitlab_jobs(template).values()))["script"])
    for template in (JENKINS, JENKINS_GATE):
        found[template.name] = "\n".join(sh_scripts(template.read_text()))
    return found


@pytest.mark.parametrize("name", ["github-actions.yaml", "github-actions-gate.yaml", "gitlab-ci.yaml",
                                  "gitlab-ci-gate.yaml", "Jenkinsfile", "Jenkinsfile.gate"])
def test_preflight_prints_the_worst_case_before_the_run_with_the_same_options(name: str) -> None:
    script = run_scripts()[name]
    verb = "gate" if "gate" in name else "run"
    assert 0 <= script.index('gpucanary" preflight ') < script.index(f'gpucanary" {verb} ')
    [preflight], [run] = commands(script, "preflight"), commands(script, verb)
    same = ("gpucanary-kubeconfig", "gpucanary-driver-version", "gpucanary-pool-provider", "gpucanary-pool-selector",
            "gpucanary-reports-dir")
    assert {k: preflight[k] for k in same} == {k: run[k] for k in same}
    assert preflight["gpucanary-policy"] == (run["head"] if verb == "gate" else run["gpucanary-policy"])


# --- deployment gates on the canary's verdict ----------------------------------------------------------

GITHUB_DEPLOY = TEMPLATES / "github-actions-deploy.yaml"
ARGOCD_PRESYNC = TEMPLATES / "argocd-presync-verdict.yaml"


@pytest.mark.parametrize("template", [GITHUB, GITHUB_GATE, GITHUB_DEPLOY], ids=["run", "gate", "deploy"])
def test_actionlint_and_shellcheck_accept_the_github_templates(template: Path, actionlint: str, tmp_path: Path) -> None:
    result = run_actionlint(actionlint, template, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_github_deploy_rolls_out_only_after_the_verdict_of_its_own_policy_and_driver() -> None:
    workflow = github(GITHUB_DEPLOY)
    assert workflow["permissions"] == {"contents": "read"} and "pull_request_target" not in workflow["on"]
    [job] = workflow["jobs"].values()
    assert job["environment"] == "gpu-production" and job["env"]["GPUCANARY_VERSION"] == VERSION
    names = [s.get("name", "") for s in job["steps"]]
    verdict, rollout = names.index(next(n for n in names if "verdict" in n)), names.index("Roll out")
    assert verdict < rollout and "if" not in job["steps"][rollout]        # a held verdict stops the job before it
    script = job["steps"][verdict]["run"]
    assert '"$RUNNER_TEMP/gpucanary/venv/bin/gpucanary" verdict' in script
    for option in ('--gpucanary-policy="$CANARY_POLICY"', '--gpucanary-driver-version="$CANARY_DRIVER_VERSION"',
                   '--max-age-h="$CANARY_MAX_AGE_H"'):
        assert option in script
    assert job["env"]["CANARY_POLICY"] == github()["jobs"]["canary"]["env"]["CANARY_POLICY"]  # what the canary ran


def test_the_argocd_presync_hook_fails_the_sync_without_a_verdict_and_only_reads() -> None:
    docs = list(yaml.safe_load_all(ARGOCD_PRESYNC.read_text()))
    [job] = [d for d in docs if d["kind"] == "Job"]
    assert job["metadata"]["annotations"]["argocd.argoproj.io/hook"] == "PreSync"
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    [container] = job["spec"]["template"]["spec"]["containers"]
    script = container["args"][0]
    assert "exec gpucanary verdict --gpucanary-kubeconfig=/tmp/kubeconfig" in script
    assert not shellcheck(script, shell="sh"), shellcheck(script, shell="sh")
    rules = [rule for d in docs if d["kind"] in ("Role", "ClusterRole") for rule in d["rules"]]
    assert rules and {verb for rule in rules for verb in rule["verbs"]} <= {"get", "list"}
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == "gpucanary-verdict-reader"
