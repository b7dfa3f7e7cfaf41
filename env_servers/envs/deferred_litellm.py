"""litellm, imported when it is first used instead of when Aviary is imported.

Importing Aviary imports litellm (about 5 s of a 6 s env-server import on 2 cores): `aviary.utils`
takes `acompletion` for answers graded by an LLM and the notebook environment imports the module,
although neither gsm8k, toy nor notebook calls an LLM. `defer_litellm()`, run before Aviary is
imported, keeps every use working and moves the cost to the first call:

- `import litellm` gives a module that imports the real one on its first attribute access;
- `aviary.utils.acompletion` is a function that imports litellm's and awaits it.

If Aviary or litellm was imported already, or litellm is not installed, it changes nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

__all__ = ["defer_litellm"]


class DeferredModule(types.ModuleType):
    """Stands in for litellm in sys.modules until an attribute is asked for: then the real module
    is imported (it replaces this one in sys.modules) and answers, now and from then on."""

    def __getattr__(self, name: str) -> Any:
        real = _import_litellm()
        return getattr(real, name)


def _import_litellm() -> types.ModuleType:
    if isinstance(sys.modules.get("litellm"), DeferredModule):
        del sys.modules["litellm"]
    return importlib.import_module("litellm")


async def acompletion(*args: Any, **kwargs: Any) -> Any:
    """litellm.acompletion, imported on the first call."""
    return await _import_litellm().acompletion(*args, **kwargs)


def defer_litellm() -> None:
    if "litellm" in sys.modules or "aviary.utils" in sys.modules or importlib.util.find_spec("litellm") is None:
        return  # too late, or not installed (Aviary falls back on its own)
    # aviary.utils runs `from litellm import acompletion`, which would import it at once: while
    # aviary.utils is imported litellm reads as absent (Aviary's own fallback, acompletion = None),
    # then it gets the deferred acompletion.
    sys.modules["litellm"] = None  # type: ignore[assignment]
    try:
        import aviary.utils
    finally:
        del sys.modules["litellm"]
    aviary.utils.acompletion = acompletion
    stub = DeferredModule("litellm", "litellm, imported on first use (env_servers.envs.deferred_litellm)")
    stub.__spec__ = None  # an `import litellm` finds it in sys.modules and looks no further
    sys.modules["litellm"] = stub
