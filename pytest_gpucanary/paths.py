"""Files shipped beside the package: manifests, example policies, KWOK stages, node templates."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "fixtures"
