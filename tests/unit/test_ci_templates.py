"""The CI templates users copy: checked by the tools each CI would apply, plus what those tools miss.

GitHub: actionlint (built by ci/build-actionlint.sh, with shellcheck on every run: script).
GitLab: the YAML parsed, its job's keys and scripts checked, the scripts shellchecked.
Jenkins: no offline Jenkins linter exists; the Jenkinsfile is compiled by groovyc (syntax), its
sh scripts are shellchecked, and the declarative structure is read from the source.
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

from pytest_gpucanary.config import REPO_ROOT

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


def github() -> dict:
    workflow = yaml.safe_load(GITHUB.read_text())
    workflow["on"] = workflow.pop(True, workflow.get("on"))   # YAML 1.1 reads the key `on` as true
    return workflow


def steps() -> list[dict]:
    return github()["jobs"]["canary"]["steps"]


def step(name_part: str) -> dict:
    [found] = [s for s in steps() if name_part in s.get("name", "")]
    return found


def test_actionlint_and_shellcheck_accept_the_github_template(actionlint: str, tmp_path: Path) -> None:
    result = run_actionlint(actionlint, GITHUB, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


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


@pytest.fixture
def gitlab_job() -> dict:
    document = yaml.safe_load(GITLAB.read_text())
    assert list(document) == ["gpu-driver-canary"]
    return document["gpu-driver-canary"]


def test_gitlab_job_uses_only_gitlab_keywords(gitlab_job: dict) -> None:
    assert set(gitlab_job) <= GITLAB_JOB_KEYWORDS, set(gitlab_job) - GITLAB_JOB_KEYWORDS
    assert all(isinstance(line, str) for line in gitlab_job["script"] + gitlab_job["after_script"])


def test_gitlab_one_canary_per_cluster_and_the_job_id_as_run_id(gitlab_job: dict) -> None:
    assert gitlab_job["resource_group"] == "gpucanary-$CANARY_CLUSTER"
    assert gitlab_job["variables"]["CANARY_RUN_ID"] == "gl-$CI_JOB_ID"
    assert '--gpucanary-run-id="$CANARY_RUN_ID"' in gitlab_job["script"][-1]
    assert 'cleanup --kubeconfig "$CANARY_KUBECONFIG" --run-id "$CANARY_RUN_ID"' in gitlab_job["after_script"][0]


def test_gitlab_kubeconfig_must_be_a_file_variable_made_mode_600(gitlab_job: dict) -> None:
    first = gitlab_job["script"][0].splitlines()
    assert first[0].startswith('test -f "${CANARY_KUBECONFIG:-}" ||') and "File-type" in first[0]
    assert first[1] == 'chmod 600 "$CANARY_KUBECONFIG"'
    assert "CANARY_KUBECONFIG" not in gitlab_job["variables"]   # a project variable, never in the file


def test_gitlab_publishes_pytest_junit_once_and_the_reports_always(gitlab_job: dict) -> None:
    artifacts = gitlab_job["artifacts"]
    assert artifacts["when"] == "always" and artifacts["paths"] == ["reports/"]
    assert artifacts["reports"] == {"junit": "reports/junit.xml"}
    assert "--junitxml=reports/junit.xml" in gitlab_job["script"][-1]


def test_gitlab_scripts_pass_shellcheck(gitlab_job: dict) -> None:
    for part in ("script", "after_script"):   # a shell runner runs each part's lines in one bash
        script = "#!/bin/bash\nset -eo pipefail\n" + "\n".join(gitlab_job[part]) + "\n"
        assert shellcheck(script, shell="bash") == "", part


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


def test_jenkinsfile_compiles_as_groovy(tmp_path: Path, jenkins: tuple[str, str]) -> None:
    env = dict(os.environ)
    if not Path("/usr/lib/jvm/default-java/bin/java").exists():   # Debian's groovyc looks there first
        env["JAVA_HOME"] = str(Path(os.path.realpath(tool("java"))).parents[1])
    (tmp_path / "Jenkinsfile.groovy").write_text(jenkins[0])
    result = subprocess.run([tool("groovyc"), "-d", str(tmp_path / "classes"), "Jenkinsfile.groovy"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    (tmp_path / "Broken.groovy").write_text(jenkins[0].rsplit("}", 1)[0])   # and it does catch a missing brace
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


def sh_scripts(source: str) -> list[str]:
    """Every sh step's script as the shell receives it (Groovy single-quoted strings, runId resolved)."""
    [run_id] = re.findall(r"^def runId = '(.*)'$", source, re.MULTILINE)
    scripts = []
    for prefix, triple, single in re.findall(r"\bsh\s+(runId \+ )?(?:'''(.*?)'''|'([^'\n]*)')", source, re.DOTALL):
        text = (triple or single).replace("\\\\", "\\")
        scripts.append((run_id.replace("\\n", "\n") if prefix else "") + text)
    return scripts


def test_jenkins_sh_scripts_are_single_quoted_and_pass_shellcheck(jenkins: tuple[str, str]) -> None:
    source, code = jenkins
    assert len(re.findall(r"\bsh\b", code)) == 4
    assert not re.search(r"\bsh\s*\(?\s*\"", code)   # no Groovy-interpolated (double-quoted) script
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


def test_actionlint_and_shellcheck_accept_the_github_gate_template(actionlint: str, tmp_path: Path) -> None:
    result = run_actionlint(actionlint, GITHUB_GATE, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


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
    assert '--run-id "$CANARY_RUN_ID-$side"' in scripts[-1]
    assert job["steps"][0]["with"] == {"persist-credentials": False, "fetch-depth": 0}


def test_gitlab_gate_runs_on_policy_merge_requests_and_its_scripts_pass_shellcheck() -> None:
    document = yaml.safe_load(GITLAB_GATE.read_text())
    assert list(document) == ["gpu-policy-gate"]
    job = document["gpu-policy-gate"]
    assert set(job) <= GITLAB_JOB_KEYWORDS and job["variables"]["GPUCANARY_VERSION"] == VERSION
    assert job["rules"] == [{"if": '$CI_PIPELINE_SOURCE == "merge_request_event"',
                             "changes": ["gpu-operator/upgrade-policy.yaml"]}]
    script = "\n".join(job["script"])
    assert '--base "git:origin/$CI_MERGE_REQUEST_TARGET_BRANCH_NAME:$CANARY_POLICY" --head "$CANARY_POLICY"' in script
    assert '--run-id "$CANARY_RUN_ID-$side"' in "\n".join(job["after_script"])
    for part in ("script", "after_script"):
        text = "#!/bin/bash\nset -eo pipefail\n" + "\n".join(job[part]) + "\n"
        assert shellcheck(text, shell="bash") == "", part


def test_jenkins_gate_runs_on_change_requests_and_its_sh_scripts_pass_shellcheck(tmp_path: Path) -> None:
    source = JENKINS_GATE.read_text()
    code = masked(source)
    assert not re.search(r"\bsh\s*\(?\s*\"", code)
    when = code[slice(*block(code, "when"))]
    assert "changeRequest()" in when and "changeset" in when
    scripts = sh_scripts(source)
    assert len(scripts) == 3
    for script in scripts:
        shell = "bash" if script.startswith("#!/bin/bash") else "sh"
        assert shellcheck(script if shell == "bash" else "#!/bin/sh\n" + script, shell=shell) == "", script
    gate = next(s for s in scripts if 'gpucanary" gate' in s)
    assert '--base "git:origin/$CHANGE_TARGET:$CANARY_POLICY"' in gate and '--gpucanary-run-id="$CANARY_RUN_ID"' in gate
    assert f"GPUCANARY_VERSION = '{VERSION}'" in source
