"""Backend options: one keyword-only dataclass per backend (``ShmOptions``,
``CollectiveOptions``, ``CudaIpcOptions``, ``NixlOptions``, ``CodecOptions``), each field
declared with ``option()`` (its ``WEIGHTSYNC_*`` variable read when the options are built),
validated with a ``ValueError`` naming the field, and taken by the registry and by
``connect`` as keywords or as ``options=``. The whole configuration surface is at most 30
``WEIGHTSYNC_*`` variables, each declared through ``option()`` or allowed below."""

from __future__ import annotations

import dataclasses
import re
import socket
import threading
from pathlib import Path

import pytest
import torch

import weightsync
from weightsync import CheckpointEngineRegistry
from weightsync.core.config import EngineConfig, option_rows

pytestmark = pytest.mark.timeout(120)

SRC = Path(__file__).resolve().parent.parent / "src" / "weightsync"
OPTIONS = ("ShmOptions", "CollectiveOptions", "CudaIpcOptions", "NixlOptions", "CodecOptions")
#: Variables read outside an options dataclass, and why.
ALLOWED = {
    "WEIGHTSYNC_TOKEN": "the job's secret: connect(token=...) or this, never a default",
    "WEIGHTSYNC_LIBIOMP5": "the OpenMP runtime `weightsync serve` preloads for vLLM-CPU",
    "WEIGHTSYNC_RAY_LOGS": "where the Ray helpers send worker logs",
    "WEIGHTSYNC_ATOMIC": "CheckpointEngineManager(atomic=...)'s default",
    "WEIGHTSYNC_SWIFT_BACKEND": "ms-swift picks engines by name, with no keywords of ours",
    "WEIGHTSYNC_SWIFT_REUSE": "ms-swift engine option (its env_vars travel to the workers)",
    "WEIGHTSYNC_SWIFT_SENDERS": "ms-swift engine option (its env_vars travel to the workers)",
}
MAX_NAMES = 30


def _cls(name):
    return getattr(weightsync, name)


# -- validation ------------------------------------------------------------------------
BAD = [
    ("ShmOptions", "direct", "sometimes"), ("ShmOptions", "direct", 1),
    ("ShmOptions", "direct_min_bytes", 0), ("ShmOptions", "direct_min_bytes", 1.5),
    ("ShmOptions", "copy_threads", 0), ("ShmOptions", "copy_threads", 65),
    ("ShmOptions", "copy_threads", True),
    ("CollectiveOptions", "direct_min_bytes", -1), ("CollectiveOptions", "direct_min_bytes", "8"),
    ("CudaIpcOptions", "zero_copy", "yes"), ("CudaIpcOptions", "zero_copy", 1),
    ("NixlOptions", "serve", "always"), ("NixlOptions", "ucx_tls", ""),
    ("NixlOptions", "ucx_tls", 3),
    ("CodecOptions", "delta", "maybe"), ("CodecOptions", "quantize", "int4"),
    ("CodecOptions", "delta_max_bytes", -1), ("CodecOptions", "quantize_skip", "embed"),
]


@pytest.mark.parametrize("cls,field,bad", BAD)
def test_a_bad_value_is_a_value_error_naming_the_field(cls, field, bad):
    with pytest.raises(ValueError, match=field):
        _cls(cls)(**{field: bad})


@pytest.mark.parametrize("cls", OPTIONS)
def test_options_are_keyword_only_dataclasses_declared_with_option(cls):
    c = _cls(cls)
    assert dataclasses.is_dataclass(c)
    with pytest.raises(TypeError):
        c(True)                                  # keyword-only
    rows = option_rows(c)
    assert [r[0] for r in rows] == [f.name for f in dataclasses.fields(c)]   # every field
    for name, env, default, doc in rows:
        assert doc.endswith(".") and "\n" not in doc, (name, doc)
        assert env == "" or env.startswith("WEIGHTSYNC_"), env
    c()                                          # the defaults are valid


# -- the environment, read at construction -------------------------------------------------
ENV = [
    ("ShmOptions", "direct", "0", False), ("ShmOptions", "direct", "auto", "auto"),
    ("ShmOptions", "copy_threads", "3", 3),
    ("CudaIpcOptions", "zero_copy", "1", True), ("CudaIpcOptions", "zero_copy", "0", False),
    ("NixlOptions", "serve", "Staging", "staging"), ("NixlOptions", "ucx_tls", "tcp", "tcp"),
    ("CodecOptions", "delta", "auto", "auto"), ("CodecOptions", "quantize", "none", None),
    ("CodecOptions", "quantize", "fp8-tensor", "fp8-tensor"),
    ("CodecOptions", "delta_max_bytes", "4096", 4096),
]


@pytest.mark.parametrize("cls,field,raw,want", ENV)
def test_each_field_reads_its_variable_when_built(monkeypatch, cls, field, raw, want):
    c = _cls(cls)
    env = {r[0]: r[1] for r in option_rows(c)}[field]
    monkeypatch.setenv(env, raw)
    assert getattr(c(), field) == want
    monkeypatch.setenv(env, "not-a-value" if field != "ucx_tls" else "")
    if field != "ucx_tls":                       # (empty: unset, the default)
        with pytest.raises(ValueError, match=env):
            c()


def test_the_engine_device_reads_weightsync_device(monkeypatch):
    """``WEIGHTSYNC_DEVICE`` (ms-swift's ``install`` hook gives engines no keywords) sets
    every engine's ``device`` when none is passed; a keyword wins; a value that is no torch
    device is a ValueError naming the variable."""
    assert {r[0]: r[1] for r in option_rows(EngineConfig)}["device"] == "WEIGHTSYNC_DEVICE"
    monkeypatch.setenv("WEIGHTSYNC_DEVICE", "cuda:1")
    assert EngineConfig().device == "cuda:1"           # torch.device checks no GPU
    assert EngineConfig(device="cpu").device == "cpu"
    engine = CheckpointEngineRegistry.new("collective", role="rollout", timeout=5)
    assert engine.config.device == "cuda:1"
    monkeypatch.setenv("WEIGHTSYNC_DEVICE", " cpu ")
    assert CheckpointEngineRegistry.new("shm", role="rollout").config.device == "cpu"
    monkeypatch.setenv("WEIGHTSYNC_DEVICE", "gpu0")
    with pytest.raises(ValueError, match="WEIGHTSYNC_DEVICE"):
        EngineConfig()
    monkeypatch.delenv("WEIGHTSYNC_DEVICE")
    assert EngineConfig().device == "cpu"


def test_every_backend_field_with_a_variable_is_tested_here():
    tested = {(c, f) for c, f, _, _ in ENV}
    for name in OPTIONS:
        for field, env, _, _ in option_rows(_cls(name)):
            if env:
                assert (name, field) in tested, (name, field)


# -- the registry: keywords or options= ------------------------------------------------------
class _StubOps:
    """Enough of the CUDA IPC operations to build a ``cuda_ipc`` engine without a GPU."""

    def __init__(self, device):
        self.device = torch.device("cpu")

    def collect(self):
        pass


@pytest.fixture
def no_cuda(monkeypatch):
    from weightsync.transport.backends.cuda_ipc.engine import CudaIpcEngine
    monkeypatch.setattr(CudaIpcEngine, "ops_factory", _StubOps)


CASES = [("shm", "ShmOptions", {"direct": False, "copy_threads": 2}, {"direct": True}),
         ("collective", "CollectiveOptions", {"direct_min_bytes": 0},
          {"direct_min_bytes": 1 << 20}),
         ("cuda_ipc", "CudaIpcOptions", {"zero_copy": True}, {"zero_copy": False}),
         ("nixl", "NixlOptions", {"serve": "staging"}, {"serve": "params"})]


@pytest.mark.parametrize("backend,cls,given,override", CASES)
def test_the_registry_takes_keywords_or_an_options_object(no_cuda, backend, cls, given,
                                                          override):
    if backend == "nixl":
        pytest.importorskip("nixl")
    kw = {"role": "trainer", "device": "cpu"}
    by_kw = CheckpointEngineRegistry.new(backend, **kw, **given)
    by_obj = CheckpointEngineRegistry.new(backend, **kw, options=_cls(cls)(**given))
    try:
        assert isinstance(by_kw.options, _cls(cls)) and by_kw.options == by_obj.options
        for field, value in given.items():
            assert getattr(by_obj.options, field) == value
        # a keyword beside options= overrides that field
        mixed = CheckpointEngineRegistry.new(backend, **kw, options=_cls(cls)(**given),
                                             **override)
        assert dataclasses.asdict(mixed.options) == {**given_all(by_obj), **override}
        mixed.finalize()
        with pytest.raises(ValueError, match=f"must be a {cls}"):
            CheckpointEngineRegistry.new(backend, **kw, options=EngineConfig())
        with pytest.raises(ValueError, match="unknown option"):
            CheckpointEngineRegistry.new(backend, **kw, no_such_option=1)
    finally:
        by_kw.finalize()
        by_obj.finalize()


def given_all(engine):
    return dataclasses.asdict(engine.options)


def test_a_backend_without_options_takes_none():
    eng = CheckpointEngineRegistry.new("inproc", role="trainer")
    assert eng.options is None
    with pytest.raises(ValueError, match="takes no backend options"):
        CheckpointEngineRegistry.new("inproc", role="trainer", options=weightsync.ShmOptions())


def test_a_codec_engine_takes_its_own_and_its_inner_backends_options():
    Codec, Shm = weightsync.CodecOptions, weightsync.ShmOptions
    eng = CheckpointEngineRegistry.new("delta+shm", role="trainer", direct=False,
                                       delta_max_bytes=1 << 20)
    assert eng.options.delta is True and eng.options.delta_max_bytes == 1 << 20  # name's delta
    assert eng.inner.options.direct is False
    eng.finalize()
    eng = CheckpointEngineRegistry.new("delta+shm", role="trainer",
                                       options=[Codec(delta="auto", quantize="fp8-block"),
                                                Shm(copy_threads=3)])
    assert (eng.options.delta, eng.options.quantize) == ("auto", "fp8-block")
    assert eng.inner.options.copy_threads == 3
    eng.finalize()
    eng = CheckpointEngineRegistry.new("fp8+shm", role="trainer", options=Shm(direct=True),
                                       quantize="fp8-tensor")
    assert eng.options.quantize == "fp8-tensor" and eng.inner.options.direct is True
    eng.finalize()
    with pytest.raises(ValueError, match="unknown option"):
        CheckpointEngineRegistry.new("delta+shm", role="trainer", zero_copy=True)


# -- connect: keywords or options= ------------------------------------------------------------
def _connect_pair(backend, trainer_kw, rollout_kw):
    from weightsync.transport.control.store import new_token
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token, out, errors = new_token(), {}, []

    def run(role, kw):
        try:
            out[role] = weightsync.connect(backend, role=role, address=f"127.0.0.1:{port}",
                                           token=token, timeout=30, bucket_size=1 << 20, **kw)
        except BaseException as exc:  # noqa: BLE001 (shown below)
            errors.append(exc)
    threads = [threading.Thread(target=run, args=("trainer", trainer_kw)),
               threading.Thread(target=run, args=("rollout", rollout_kw))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out["trainer"], out["rollout"]


def test_connect_takes_keywords_or_an_options_object():
    Shm = weightsync.ShmOptions
    tr, rx = _connect_pair("shm", {"options": Shm(direct=False, copy_threads=2)},
                           {"direct": False, "copy_threads": 2})
    try:
        assert tr.options == rx.options == Shm(direct=False, copy_threads=2)
        assert not tr._direct                      # the option took effect
    finally:
        tr.finalize()
        rx.finalize()


def test_connect_turns_codec_options_into_the_codec_backend(monkeypatch):
    """``options=CodecOptions(delta=True)`` over ``"shm"`` builds ``delta+shm``, as
    ``delta=True`` does; codec options that ask for nothing leave the plain backend."""
    Codec, Shm = weightsync.CodecOptions, weightsync.ShmOptions
    built = []

    def new(name, **kw):
        built.append((name, kw.get("options")))
        raise RuntimeError("stop here")
    monkeypatch.setattr(CheckpointEngineRegistry, "new", staticmethod(new))
    for options in (Codec(delta=True), [Codec(delta=True), Shm(direct=False)], Codec(),
                    [Codec(), Shm(direct=False)]):
        with pytest.raises(RuntimeError, match="stop here"):
            weightsync.connect("shm", role="rollout", token="t" * 32, options=options)
    assert [name for name, _ in built] == ["delta+shm", "delta+shm", "shm", "shm"]
    assert built[2][1] is None and built[3][1] == Shm(direct=False)


# -- the configuration surface ---------------------------------------------------------------
def _source_files(root):
    for path in root.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".json", ".yaml", ".yml", ".toml"):
            yield path


def _names(root=SRC):
    """Every ``WEIGHTSYNC_*`` name src mentions or reads (``env_value("X")`` / ``option("X")``),
    and those declared through ``option()``."""
    mentioned, declared = set(), set()
    for path in _source_files(root):
        text = path.read_text(errors="replace")
        mentioned |= set(re.findall(r"WEIGHTSYNC_[A-Z0-9_]+", text))
        mentioned |= {"WEIGHTSYNC_" + n for n in re.findall(r'env_value\(\s*"([A-Z0-9_]+)"', text)}
        declared |= {"WEIGHTSYNC_" + n for n in re.findall(r'\boption\(\s*"([A-Z0-9_]+)"', text)}
    mentioned |= declared
    return mentioned, declared


def test_at_most_30_variables_each_declared_or_allowed():
    mentioned, declared = _names()
    assert len(mentioned) <= MAX_NAMES, sorted(mentioned)
    stray = sorted(mentioned - declared - set(ALLOWED))
    assert not stray, f"read outside option() and not allowed: {stray}"
    assert not set(ALLOWED) & declared, "an allowed name is declared: drop it from ALLOWED"
    # the backends' declarations are what the options classes report
    for name in OPTIONS + ("EngineConfig",):
        c = EngineConfig if name == "EngineConfig" else _cls(name)
        assert {env for _, env, _, _ in option_rows(c) if env} <= declared, name


def test_the_scan_sees_what_it_should(tmp_path):
    """The scan counts a literal name, an ``env_value`` read and an ``option()`` declaration
    (so the test above can fail)."""
    (tmp_path / "a.py").write_text('x = "WEIGHTSYNC_A"\ny = env_value("B", int, 0)\n'
                                   'z = option("C", int, 0, "doc.")\n')
    mentioned, declared = _names(tmp_path)
    assert mentioned == {"WEIGHTSYNC_A", "WEIGHTSYNC_B", "WEIGHTSYNC_C"}
    assert declared == {"WEIGHTSYNC_C"}


def test_removed_variables_are_gone():
    mentioned, _ = _names()
    removed = {"SHM_PIN", "SHM_PUSH", "SHM_SHARED", "SHM_DIRECT_MIN", "SHM_DIRECT_WINDOW",
               "COLLECTIVE_DIRECT_MIN", "COLLECTIVE_DIRECT_WINDOW", "COLLECTIVE_RX_AHEAD",
               "COLLECTIVE_RX_STREAM_WAITS", "CUDA_IPC_PUSH", "CUDA_IPC_SYNC",
               "CUDA_IPC_LINKS", "CUDA_IPC_STREAM_WAITS", "CUDA_IPC_RX_STREAM_WAITS",
               "CUDA_IPC_GRAPH_BRANCHES", "CUDA_IPC_FILL_GRAPHS", "CUDA_IPC_MIN_REF_BYTES",
               "CUDA_IPC_REF_FIRST_BYTES", "NIXL_CUT", "NIXL_PIPELINE", "NIXL_PROGRESS_THREAD"}
    assert not {"WEIGHTSYNC_" + n for n in removed} & mentioned
