import atexit
import os
import shutil
import tempfile

import hypothesis
import pytest

# One XLA compilation cache for the whole session, the trainer's subprocesses included (they
# inherit the environment): the many Trainers the tests build compile the same tiny-model programs,
# and each is compiled once. A fresh directory per session keeps runs independent of each other.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="mpo-jax-test-xla-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# Trackio keeps its projects under TRACKIO_DIR (default ~/.cache/huggingface/trackio), read once,
# on import: the tracker tests write to a directory of this session's own, never the user's store
# (even one the user chose with TRACKIO_DIR), and it is removed at exit.
_trackio = tempfile.mkdtemp(prefix="mpo-jax-test-trackio-")
atexit.register(shutil.rmtree, _trackio, ignore_errors=True)
os.environ["TRACKIO_DIR"] = _trackio

# The tests' programs are tiny and many: XLA's cheapest CPU code generation compiles them about a
# quarter faster (measured on the preset sweep) and runs them no slower at these sizes; the
# trainer's subprocesses inherit it. Benchmarks and real runs keep the default optimisation.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    ).strip()

import jax  # noqa: E402  (after the environment: jax reads it on import)

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# Deterministic, CI-sized property runs; `HYPOTHESIS_PROFILE=thorough` for a deeper local search.
hypothesis.settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True, print_blob=True
)
hypothesis.settings.register_profile("thorough", max_examples=500, deadline=None)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """(PyTorch model, our model) of the tiny dense Qwen3 checkpoint (tests/models.py), built
    and loaded once per session."""
    from tests.models import save_tiny_qwen3
    from train.model.weights import load_pretrained

    path = tmp_path_factory.mktemp("tiny_qwen3")
    return save_tiny_qwen3(path), load_pretrained(path)
