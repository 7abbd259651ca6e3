"""Files shipped beside the package: manifests, example policies, KWOK stages, the shipped gate.

From a checkout they sit at the repository root; an installed wheel carries them under
<prefix>/share/gpucanary (see pyproject's data-files).
"""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
_SHARED = Path(sys.prefix) / "share" / "gpucanary"
_BASE = REPO_ROOT if (REPO_ROOT / "fixtures").is_dir() else _SHARED

FIXTURES = _BASE / "fixtures"
CANARIES = _BASE / "canaries"
