"""Third-party output while torch and megatron-core are imported, held back unless asked for.

Importing them prints warnings and log lines that say nothing about the code under test (no
CUDA_HOME, no Transformer Engine, no Apex, no absl). `import_quietly` imports modules with
file descriptors 1 and 2 sent to a temporary file, so Python warnings, ``logging`` handlers and
C-level prints are all held; the held text is written to stderr only when the import fails, or
not held at all when `VERBOSE_ENV` is ``1`` (``pipemetrics ... -v`` sets it for every process
it starts: the fork server, ranks and the target's probe inherit it). `keep_compile_cache`
keeps what the import of megatron-core writes to disk out of the temporary directory.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile

VERBOSE_ENV = "PIPEMETRICS_VERBOSE"
"""``1``: show what imports of torch and megatron-core print (``-v``)."""


COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def keep_compile_cache() -> None:
    """Point torch.compile's cache, which importing megatron-core creates (as
    ``torchinductor_<user>`` under the temporary directory, unless told otherwise), at a
    persistent cache of pipemetrics' (``~/.cache/pipemetrics/torchinductor``), so that no run
    leaves it behind as litter; a cache directory the environment already names is kept. Call it
    before anything imports torch; the processes started later inherit it."""
    os.environ.setdefault(
        COMPILE_CACHE_ENV,
        os.path.join(os.path.expanduser("~"), ".cache", "pipemetrics", "torchinductor"),
    )


def verbose() -> bool:
    """Whether third-party import output is shown (`VERBOSE_ENV`)."""
    return os.environ.get(VERBOSE_ENV) == "1"


def import_quietly(*modules: str) -> None:
    """Import ``modules``, holding back what the imports print unless `verbose`.

    On failure the held text goes to stderr before the exception propagates, so a user sees why
    an import failed. Modules already imported cost nothing.
    """
    todo = [name for name in modules if name not in sys.modules]
    if not todo or verbose():
        for name in todo:
            importlib.import_module(name)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as held:
        saved = (os.dup(1), os.dup(2))
        failed = False
        try:
            os.dup2(held.fileno(), 1)
            os.dup2(held.fileno(), 2)
            for name in todo:
                importlib.import_module(name)
        except BaseException:
            failed = True
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            if failed:
                held.seek(0)
                text = held.read().decode(errors="replace")
                if text:
                    sys.stderr.write(f"output of importing {', '.join(todo)}:\n{text}")
                    sys.stderr.flush()
