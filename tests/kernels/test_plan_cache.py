"""The pack plan cache: one LRU per device, guarded by a lock,
big enough that packing an 80-layer model one layer at a time (sglang's staging path)
never evicts a plan it will ask for again; the old 64-entry cache missed on every call
there, and each miss was a blocking host-to-device copy on CUDA.  And what else a launch
costs on the host: its arguments made once per plan, the pool's whole-pool plan found
without keying, layer indices never read from a device."""

from __future__ import annotations

import threading

import pytest
import torch

from kvmem.kernels.pack import plan as P

LAYERS = 80
HEAD_RANGES = [None, (0, 2), (2, 4), (1, 3)]


def _model(seed: int):
    """Per-layer K/V lists of an 80-layer model: [num_pages, page_size, H, D] each."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda: torch.randint(0, 100, (3, 2, 4, 8), generator=g).to(torch.float16)  # noqa: E731
    return [mk() for _ in range(LAYERS)], [mk() for _ in range(LAYERS)]


def test_per_layer_plans_of_two_80_layer_models_stay_cached(monkeypatch):
    models = [_model(1), _model(2)]  # two pools, e.g. two ranks' buffers in one process
    first = {}
    for m, (ks, vs) in enumerate(models):
        for heads in HEAD_RANGES:
            for layer in range(LAYERS):
                first[m, heads, layer] = P.make_plan(ks, vs, None, [layer], heads)
    assert len(first) == 2 * LAYERS * len(HEAD_RANGES) == 640
    made = []
    real = P._make_plan
    monkeypatch.setattr(P, "_make_plan", lambda *a: made.append(a) or real(*a))
    for (m, heads, layer), plan in first.items():
        ks, vs = models[m]
        assert P.make_plan(ks, vs, None, [layer], heads) is plan
    assert made == []  # a second pass makes no plan: no host work, no device copy


def test_cache_is_per_device_and_bounded():
    ks, vs = _model(3)
    plan = P.make_plan(ks, vs, None, [0], None)
    cache = P._PLANS[torch.device("cpu")]
    assert any(p is plan for p in cache.values())
    assert P._PLAN_CACHE_SIZE >= 2 * LAYERS * len(HEAD_RANGES)
    assert len(cache) <= P._PLAN_CACHE_SIZE


def test_make_plan_goes_through_the_lock(monkeypatch):
    held = []

    class Recording:
        def __init__(self):
            self.lock = threading.Lock()

        def __enter__(self):
            self.lock.acquire()
            held.append(True)

        def __exit__(self, *exc):
            self.lock.release()

    monkeypatch.setattr(P, "_LOCK", Recording())
    ks, vs = _model(4)
    P.make_plan(ks, vs, None, [5], (1, 2))  # a miss: lookup, then insert
    P.make_plan(ks, vs, None, [5], (1, 2))  # a hit: lookup
    assert len(held) == 3


def test_threads_asking_for_the_same_plans_get_the_same_objects():
    ks, vs = _model(5)
    keys = [([layer], heads) for layer in range(20) for heads in HEAD_RANGES]
    results: list[list] = [[] for _ in range(8)]
    errors = []
    start = threading.Barrier(8)

    def work(out):
        try:
            start.wait()
            for layers, heads in keys:
                out.append(P.make_plan(ks, vs, None, layers, heads))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for r in results[1:]:
        assert all(a is b for a, b in zip(r, results[0])) and len(r) == len(keys)


# -- what a launch costs on the host ------------------------------------------------------


class _Kernel:
    """Stands in for the Triton kernel: records each launch's grid and arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_launches_of_a_plan_reuse_its_arguments(monkeypatch):
    """The launch's 21 constexpr arguments are made once per plan and direction, not per
    launch (host work on every call, in the hot path)."""
    from kvmem.kernels.pack import triton as T

    kernel, made = _Kernel(), []
    real = T.kernel_params
    monkeypatch.setattr(T, "_copy_pages_kernel", kernel)
    monkeypatch.setattr(
        T, "kernel_params", lambda plan, pack: made.append(pack) or real(plan, pack)
    )
    ks, vs = _model(6)
    plan = P.make_plan(ks, vs, None, [3, 1], (1, 3))
    ids = torch.tensor([2, 0])
    chunk = torch.empty(plan.nbytes(2), dtype=torch.uint8)
    for pack in (True, False, True, False, True):
        T._launch(plan, ks, ids, chunk, pack)
    assert made == [True, False]
    assert len(kernel.launches) == 5
    for (grid, _, kwargs), pack in zip(kernel.launches, (True, False, True, False, True)):
        assert grid == (2, 4)
        assert kwargs == dict(real(plan, pack), num_warps=T._NUM_WARPS)


def test_pool_finds_its_whole_pool_plan_without_keying_again(monkeypatch):
    """pack_pages of the whole pool (layers and heads None, the common call) finds its
    plan without validating the selection again: no tuple of every layer index built and
    hashed per call."""
    import kvmem
    from kvmem.kernels import pack as _pack

    spec = kvmem.KVSpec(num_layers=80, num_kv_heads=2, head_dim=8, page_size=2, dtype=torch.float16)
    pool = kvmem.KVPool(spec, num_pages=5)
    first = kvmem.pack_pages(pool, [1, 3])
    checked = []
    real = _pack._check_layers
    monkeypatch.setattr(_pack, "_check_layers", lambda *a: checked.append(a) or real(*a))
    for _ in range(3):
        assert torch.equal(kvmem.pack_pages(pool, [1, 3]), first)
    assert checked == []
    kvmem.pack_pages(pool, [1], layers=[0, 2])  # a selection is still validated
    assert len(checked) == 1
    with pytest.raises(ValueError, match=r"layers: 80 is not a layer index"):
        kvmem.pack_pages(pool, [1], layers=[80])


@pytest.mark.parametrize("device", ["meta"])
def test_layers_on_a_device_are_refused(device):
    """A tensor of layer indices on a device would be read on the host on every call (a
    hidden sync on CUDA): refused, naming the device; a CPU tensor is fine."""
    ks, vs = _model(7)
    with pytest.raises(
        ValueError,
        match=rf"layers is a tensor on {device}: reading it "
        r"would cost a host sync",
    ):
        P.make_plan(ks, vs, None, torch.tensor([0, 1], device=device), None)
    assert P.make_plan(ks, vs, None, torch.tensor([1, 0]), None).layers == (1, 0)
