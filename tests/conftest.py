"""The suite's fixture every test takes, and its helpers on the path: tests/support (cudasim,
the job scripts, harness.py) is importable from every folder of the tree."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

from harness import ROOT  # noqa: E402 (found through the path just set)

# The fast tier (pytest -m "not slow", about two minutes on two cores) leaves out the tests that run
# whole commands as processes (tests/cli, tests/dev) but for a few quick ones, and the
# in-process tests that compile or run kernels on cudasim by the dozen. What it keeps still
# imports and calls every module of the package.
SLOW_FOLDERS = ("cli", "dev")
FAST_FILES = {"cli/test_train.py", "cli/test_schedule_command.py", "cli/test_timeline.py"}
SLOW_FILES = {"unit/backends/test_flash_attention.py", "unit/backends/test_cudnn_attention.py",
              "unit/backends/test_kernels_compile.py", "support/test_cudasim.py"}
# in-process tests that run whole commands or many processes (a test id, or its start)
SLOW_TESTS = (
    "unit/test_imports.py::test_every_module_imports_alone",
    "unit/backends/test_cuda_backend.py::test_train_picks_the_gpu_and_lowers_the_loss",
    "unit/backends/test_cuda_backend.py::test_resume_matches",
    "unit/backends/test_cuda_backend.py::test_graph_replay_equals_eager",
    "unit/backends/test_cuda_backend.py::test_verify_bf16_cuda",
    "unit/backends/test_cuda_backend.py::test_verify_cuda[sim-odd",
    "unit/backends/test_cuda_backend.py::test_verify_cuda[sim-gpt2v",
    "unit/backends/test_cuda_backend.py::test_bf16_trains_as_the_numpy_reference",
    "unit/backends/test_cuda_backend.py::test_tf32_reaches_the_gemms",
    "unit/backends/test_cuda_backend.py::test_bench_writes_json[sim-bf16",
    "unit/backends/test_cuda_backend.py::test_bench_says_which_epilogue_fell_back",
    "unit/backends/test_cuda_backend.py::test_recompute_keeps_the_bits",
    "unit/backends/test_cuda_backend.py::test_sampling_on_the_kv_cache",
    "unit/backends/test_cuda_backend.py::test_bf16_head_chunks_hold_in_any_block_order",
    "unit/backends/test_cuda_backend.py::test_a_kernel_cache_that_cannot_be_written",
    "unit/formats/test_hf.py::test_trained_model_gives_transformers_the_same_val_loss",
    "unit/formats/test_hf.py::test_llmc_hf_llmc_is_byte_identical",
    "unit/formats/test_hf.py::test_exported_model_and_tokenizer_load_in_transformers",
    "unit/train/test_loader.py::test_a_resume_mid_epoch_is_bit_identical_on_a_grid",
    "unit/comm/test_peer_waits.py::test_a_stopped_peer_ends_every_host_wait",
)


def pytest_collection_modifyitems(config, items):
    tests = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        rel = os.path.relpath(str(item.path), tests).replace(os.sep, "/")
        test_id = rel + "::" + item.name
        if rel in SLOW_FILES or (rel.split("/")[0] in SLOW_FOLDERS and rel not in FAST_FILES) \
                or test_id.startswith(SLOW_TESTS):
            item.add_marker(pytest.mark.slow)


def checkout_out():
    """What the checkout's out/ holds (a user's `python cli.py train` writes it): each
    file's path, size and modification time."""
    found = {}
    for d, _, files in os.walk(os.path.join(ROOT, "out")):
        for f in files:
            st = os.lstat(os.path.join(d, f))
            found[os.path.join(d, f)] = (st.st_size, st.st_mtime_ns)
    return found


@pytest.fixture(autouse=True)
def own_directory(tmp_path_factory, monkeypatch):
    """Each test's commands run in an empty directory of its own: a default output
    (train's -o out, bench.json, loss.png) never meets what a user's run left in the
    checkout, nor lands there; the checkout's out/ is as it was after the test."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    before = checkout_out()
    yield
    assert checkout_out() == before, "the test wrote into the checkout's out/"
