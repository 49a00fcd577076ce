"""Test-wide settings: tiny models are overhead-bound, and one intra-op thread avoids oversubscribing a 2-core box
(Ray workers and DeepSpeed ranks started by tests run beside the test process). Measured GEMM plans
(models/native/gemm.py) are kept in a directory of this run's own, not in the user's cache.

The session ends with `os._exit(status)` once pytest has reported, where this process ran Ray: the deployment tests
start and shut down several Rays (and Serve's handles) in this one process, which Ray does not support cleanly
(ray-project/ray#31145: background threads keep pointers into a shut-down core worker), and the interpreter's own
teardown then crashed once after every test had passed (a thread jumping into freed memory, in the clean-clone CI
run of 2026-11-27). A server process starts one Ray and never tears down the interpreter that way. Every test's
outcome and the exit status are unchanged."""

import os
import sys
import tempfile

import pytest
import torch

torch.set_num_threads(1)
# one cache for the whole run, shared by pytest-xdist's workers (they build the native kernels once between them)
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if _RUN:
    os.environ["RAY_SPECDEC_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"ray_specdec_test_cache_{_RUN}")
    os.makedirs(os.environ["RAY_SPECDEC_CACHE_DIR"], exist_ok=True)
else:
    os.environ["RAY_SPECDEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="ray_specdec_test_cache_")

# after the settings above: the package reads them as it loads
from ray_specdec import factory  # noqa: E402
from ray_specdec.models.target.model import TargetModel  # noqa: E402
from tests.helpers.models import tiny_gpt_neox, tiny_llama, tiny_mamba, tiny_tokenizer  # noqa: E402

_exit_status: list[int] = []

# Tests that start Ray run one after another on one pytest-xdist worker (`--dist loadgroup`): two Rays at once would
# share the two cores with each other's replicas, and their health and recovery deadlines are real seconds.
RAY_TESTS = ("tests/deployments/", "tests/serving/test_proxy_guard.py", "tests/benchmarks/test_tp_loop.py",
             "tests/benchmarks/test_logits_shipping.py", "tests/benchmarks/test_served_ab.py")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(RAY_TESTS):
            item.add_marker(pytest.mark.xdist_group("ray"))


def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After every other plugin's unconfigure (the report is out): leave without the interpreter's teardown where a
    Ray ran in this process."""
    if _exit_status and "ray._raylet" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])


TARGETS = {"neox": tiny_gpt_neox, "llama": tiny_llama}


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(request):
    """A float64 tiny target of each family."""
    return TargetModel(TARGETS[request.param](torch.float64, max_positions=512))


@pytest.fixture(scope="module")
def long_context_pair():
    """A float32 batch-invariant tiny target with a long context and a random (rarely agreeing) drafter."""
    return TargetModel(tiny_gpt_neox(torch.float32, max_positions=2300)), tiny_mamba(torch.float32)


@pytest.fixture(scope="module")
def cli_model_dirs(tmp_path_factory):
    """(target dir with a tiny tokenizer, drafter dir) for the CLI and load_engine."""
    from transformers import MambaConfig, MambaForCausalLM

    root = tmp_path_factory.mktemp("models")
    tok = tiny_tokenizer()
    vocab = len(tok)
    target = tiny_gpt_neox(vocab=vocab)
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = MambaForCausalLM(MambaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, state_size=8))
    drafter.save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


@pytest.fixture
def built_engines(monkeypatch):
    """The engines the CLI builds, as built."""
    built = []
    load_engine = factory.load_engine

    def load_and_keep(*args, **kwargs):
        built.append(load_engine(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(factory, "load_engine", load_and_keep)
    return built
