"""Elastic windows' policy on given loads (librollingkv-pool-sim: the library's own llama_rkv_pool_rebalance), with the
rows simulated: after every step each cell in use must be where the windows say it lives (its device row in the pool,
or its host row), holding what was written to it. The copies the policy asks for are carried out on the simulated rows,
so a wrong copy list shows as a misplaced cell (a control below drops copies and must be caught)."""

from __future__ import annotations

import ctypes
import random

import pytest

pytestmark = pytest.mark.build

BLOCK = 256
DEMOTE, RELOCATE, PROMOTE = 0, 1, 2


@pytest.fixture(scope="module")
def sim_lib(cpu_build):
    lib = ctypes.CDLL(str(cpu_build.lib_dir / "librollingkv-pool-sim.so"))
    lib.rollingkv_pool_new.restype = ctypes.c_void_p
    lib.rollingkv_pool_new.argtypes = [ctypes.c_uint32] * 3
    lib.rollingkv_pool_begin_batch.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint8)]
    lib.rollingkv_pool_step.restype = ctypes.c_int32
    lib.rollingkv_pool_step.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                                        ctypes.POINTER(ctypes.c_uint8), ctypes.POINTER(ctypes.c_uint32), ctypes.c_int32]
    lib.rollingkv_pool_windows.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                                           ctypes.POINTER(ctypes.c_uint64)]
    lib.rollingkv_pool_free.argtypes = [ctypes.c_void_p]
    return lib


class Cache:
    """n_stream streams of kv_size cells, a pool of capacity device rows and a host row for every cell; cells are placed
    append-only (cell = position) as llama.cpp places one sequence per stream."""

    def __init__(self, lib, n_stream, kv_size, capacity, drop=None):
        self.lib, self.ns, self.kv, self.cap = lib, n_stream, kv_size, capacity
        self.h = lib.rollingkv_pool_new(n_stream, kv_size, capacity)
        self.dev = [None] * capacity
        self.host = [[None] * kv_size for _ in range(n_stream)]
        self.ext = [0] * n_stream  # cells in use: [0, ext)
        self.version = 0
        self.drop = drop  # a copy kind the control leaves out
        self.copies: list[tuple] = []

    def close(self):
        self.lib.rollingkv_pool_free(self.h)

    def windows(self):
        base, cells, epoch = (ctypes.c_uint32 * self.ns)(), (ctypes.c_uint32 * self.ns)(), ctypes.c_uint64()
        self.lib.rollingkv_pool_windows(self.h, base, cells, ctypes.byref(epoch))
        return list(base), list(cells), epoch.value

    def where(self, s, c, base, cells):
        return ("dev", base[s] + c) if c < cells[s] else ("host", s, c)

    def read(self, loc):
        return self.dev[loc[1]] if loc[0] == "dev" else self.host[loc[1]][loc[2]]

    def write(self, loc, v):
        if loc[0] == "dev":
            self.dev[loc[1]] = v
        else:
            self.host[loc[1]][loc[2]] = v

    def batch(self, *ubatches: dict[int, int]):
        """One llama_decode: its ubatches in order (a stream in any of them is in the batch)."""
        in_batch = [1 if any(s in u for u in ubatches) else 0 for s in range(self.ns)]
        self.lib.rollingkv_pool_begin_batch(self.h, (ctypes.c_uint8 * self.ns)(*in_batch))
        copies = []
        for u in ubatches:
            copies += self._ubatch(u)
        self.copies = copies
        return copies

    def ubatch(self, grow: dict[int, int]):
        """A batch of one ubatch."""
        return self.batch(grow)

    def _ubatch(self, grow: dict[int, int]):
        """A ubatch that appends grow[s] cells to each stream s in it (0: one of its cells rewritten in place)."""
        ext_old = list(self.ext)
        ext_new = [min(self.kv, e + grow.get(s, 0)) for s, e in enumerate(self.ext)]
        in_ub = [1 if s in grow else 0 for s in range(self.ns)]
        out = (ctypes.c_uint32 * (6 * 4096))()
        n = self.lib.rollingkv_pool_step(self.h, (ctypes.c_uint32 * self.ns)(*ext_old), (ctypes.c_uint32 * self.ns)(*ext_new),
                                         (ctypes.c_uint8 * self.ns)(*in_ub), out, 4096)
        assert 0 <= n <= 4096
        copies = [tuple(out[6 * i:6 * i + 6]) for i in range(n)]
        for kind, s, c0, k, src, dst in copies:
            assert k > 0 and c0 + k <= self.kv and s < self.ns
            if kind == self.drop:
                continue
            if kind == DEMOTE:
                assert src + k <= self.cap
                for i in range(k):
                    self.host[s][c0 + i] = self.dev[src + i]
            elif kind == PROMOTE:
                assert dst + k <= self.cap
                for i in range(k):
                    self.dev[dst + i] = self.host[s][c0 + i]
            else:
                assert src + k <= self.cap and dst + k <= self.cap
                assert src + k <= dst or dst + k <= src, "a relocation piece overlaps itself"
                self.dev[dst:dst + k] = self.dev[src:src + k]
        base, cells, _ = self.windows()
        # the ubatch writes its cells where the new windows put them
        for s in grow:
            lo = ext_old[s] if grow[s] > 0 else max(0, ext_old[s] - 1)
            for c in range(lo, ext_new[s]):
                self.version += 1
                self.write(self.where(s, c, base, cells), (s, c, self.version))
                self.truth[s][c] = (s, c, self.version)
        self.ext = ext_new
        self.check(base, cells)
        return copies

    def end(self, s):
        """The sequence of stream s is removed (its cells freed; the data stays, unused)."""
        self.ext[s] = 0
        self.truth[s] = {}

    truth: list[dict]

    def check(self, base, cells):
        # windows: whole, disjoint, in the pool, never beyond the blocks in use
        spans = sorted((base[s], base[s] + cells[s]) for s in range(self.ns) if cells[s])
        assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:])), f"windows overlap: {spans}"
        assert all(0 <= a and b <= self.cap for a, b in spans)
        for s in range(self.ns):
            assert cells[s] <= min(self.kv, -(-self.ext[s] // BLOCK) * BLOCK), (s, cells[s], self.ext[s])
            for c in range(self.ext[s]):
                got = self.read(self.where(s, c, base, cells))
                assert got == self.truth[s].get(c), f"stream {s} cell {c}: {got} != {self.truth[s].get(c)}"


def new_cache(lib, n_stream, kv_size, capacity, **kw):
    c = Cache(lib, n_stream, kv_size, capacity, **kw)
    c.truth = [{} for _ in range(n_stream)]
    return c


def test_empty_windows_sit_where_static_windows_would(sim_lib):
    c = new_cache(sim_lib, 4, 4096, 4 * 1024)
    base, cells, epoch = c.windows()
    assert base == [0, 1024, 2048, 3072] and cells == [0] * 4 and epoch == 0
    c.close()


def test_everything_fits_everything_resident(sim_lib):
    """Four sequences whose cells fit the pool together: each window covers its cells (nothing in a tail)."""
    c = new_cache(sim_lib, 4, 4096, 4 * 1024)
    for s, n in enumerate([900, 250, 1700, 60]):
        c.ubatch({s: n})
    for _ in range(40):
        c.ubatch({s: 1 for s in range(4)})
    base, cells, _ = c.windows()
    assert all(cells[s] >= c.ext[s] for s in range(4)), (cells, c.ext)
    c.close()


def test_a_long_sequence_takes_the_idle_cells_and_gives_them_back(sim_lib):
    """One long request alone spreads over the whole pool (static windows would hold a quarter); when it ends, the
    short ones that spilled beside it are promoted at their next ubatch."""
    c = new_cache(sim_lib, 4, 8192, 4 * 1024)
    c.ubatch({0: 3000})
    assert c.windows()[1][0] == 3072  # the whole need, not the static 1024
    for s in (1, 2, 3):
        c.ubatch({0: 1, s: 400})  # the long one decodes on while the short ones arrive
    base, cells, _ = c.windows()
    # the pool holds 4096 cells: 3072 went to the long one, the rest to the first short one, none is taken from an active one
    assert cells[0] == 3072 and sum(cells) <= 4096
    for _ in range(5):
        c.ubatch({s: 1 for s in range(4)})
    c.end(0)
    c.ubatch({1: 1, 2: 1, 3: 1})
    base, cells, _ = c.windows()
    assert cells[0] == 0 and all(cells[s] >= c.ext[s] for s in (1, 2, 3)), (cells, c.ext)
    assert any(k == PROMOTE for k, *_ in c.copies)
    c.close()


def test_windows_return_to_the_static_layout_once_the_active_streams_fit(sim_lib):
    """A long request ends but its slot keeps its cells (llama-server's prompt cache): once the short ones beside it fit
    their shares, the idle stream keeps only its share (its excess demoted once) and the windows sit at the static layout
    again, which upstream's one op over all streams reads (the H100 decoded the short ones at 0.65x resident while the
    idle window held the pool off it)."""
    c = new_cache(sim_lib, 4, 8192, 4 * 1024)
    c.ubatch({0: 3000})
    c.ubatch({0: 1, 1: 400, 2: 400})
    assert c.windows()[1][0] == 3072
    c.ubatch({1: 1, 2: 1})           # 0 finished: still active for this batch
    assert c.windows()[1][0] == 3072
    c.ubatch({1: 1, 2: 1})           # 0 idle: down to its share, the rest of its cells to its host rows
    base, cells, _ = c.windows()
    assert cells[0] == 1024 and list(base) == [0, 1024, 2048, 3072], (base, cells)
    assert any(k == DEMOTE and s == 0 for k, s, *_ in c.copies)
    assert all(cells[s] >= c.ext[s] for s in (1, 2))
    c.ubatch({1: 1, 2: 1})           # nothing more moves
    assert c.copies == [] and list(c.windows()[0]) == [0, 1024, 2048, 3072]
    c.close()


def test_an_idle_stream_is_demoted_least_recently_used_first_and_an_active_one_never(sim_lib):
    c = new_cache(sim_lib, 4, 8192, 4 * 1024)
    c.ubatch({0: 1000})           # then idle (a finished request whose cells the server keeps)
    c.ubatch({1: 1000})           # then idle, used after 0
    c.ubatch({2: 1000})           # stays active
    for _ in range(3):
        c.ubatch({2: 1, 3: 1})    # 3 grows beside 2
    before = c.windows()[1]
    c.ubatch({2: 1, 3: 2000})     # 3 needs 2048 more than it has: the idle ones give up theirs, 0 before 1
    base, cells, _ = c.windows()
    assert cells[2] == before[2], "an active stream lost cells"
    assert cells[0] < before[0] and (cells[1] == before[1] or cells[0] == 0), (before, cells)
    assert any(k == DEMOTE for k, *_ in c.copies)
    c.close()


def test_a_finished_request_is_idle_from_the_second_batch_on(sim_lib):
    """A stream that was in the batch before is still active (a server step may miss a slot once); from the second batch
    without it, its window goes to a stream that needs the room, and that stream is whole on the device again."""
    c = new_cache(sim_lib, 2, 8192, 2048)
    c.ubatch({0: 1500, 1: 200})   # 0 takes most of the pool
    c.ubatch({0: 1, 1: 400})      # 1 outgrows what is free: it spills
    assert c.windows()[1][1] < c.ext[1]
    c.ubatch({1: 1})              # 0 finished, still active for this batch: 1 still spills
    assert c.windows()[1][1] < c.ext[1]
    c.ubatch({1: 1})              # 0 is idle now: demoted, 1 promoted, whole
    assert c.windows()[1][1] >= c.ext[1] and {k for k, *_ in c.copies} >= {DEMOTE, PROMOTE}
    c.close()


def test_a_batch_of_several_ubatches_keeps_its_streams_active(sim_lib):
    """A server step: one decode token of a generating slot, then a prompt chunk in ubatches of its own. The generating
    slot is in the first ubatch only, yet it is not demoted for the prompt in the same batch, nor in the next."""
    c = new_cache(sim_lib, 2, 8192, 2048)
    c.ubatch({0: 1000})
    for _ in range(2):
        c.batch({0: 1, 1: 1}, {1: 400}, {1: 400}, {1: 400})
        assert c.windows()[1][0] >= c.ext[0]
    c.close()


def test_no_active_stream_gives_cells_to_another(sim_lib):
    """Two active streams that together outgrow the pool: each keeps what it has, the newer cells spill."""
    c = new_cache(sim_lib, 2, 8192, 2048)
    c.ubatch({0: 1500, 1: 1})
    c.ubatch({0: 1, 1: 1500})
    w0 = c.windows()[1]
    for _ in range(100):
        c.ubatch({0: 1, 1: 1})
        w = c.windows()[1]
        assert w[0] >= w0[0] and w[1] >= w0[1]
    assert sum(c.windows()[1]) <= 2048
    c.close()


def test_windows_only_change_with_a_new_epoch(sim_lib):
    c = new_cache(sim_lib, 2, 4096, 2048)
    c.ubatch({0: 10})
    _, cells, e1 = c.windows()
    c.ubatch({0: 1})  # within the block: no change
    assert c.windows()[2] == e1 and not c.copies
    c.ubatch({0: 300})
    assert c.windows()[2] == e1 + 1
    c.close()


def random_load(c: Cache, rng: random.Random, steps: int) -> set[int]:
    """Arrivals, prefills, decode steps, departures and idle streams (cells kept, as a server keeps a finished request's)
    at random; returns the kinds of copies the policy asked for."""
    kinds: set[int] = set()
    idle_until = [0] * c.ns
    for t in range(steps):
        busy = [s for s in range(c.ns) if 0 < c.ext[s] < c.kv]
        if rng.random() < 0.04 and busy:
            c.end(rng.choice(busy))
            continue
        grow = {}
        for s in range(c.ns):
            if c.ext[s] >= c.kv:
                c.end(s)
            elif t < idle_until[s]:
                continue
            elif c.ext[s] and rng.random() < 0.02:
                idle_until[s] = t + rng.randint(10, 80)
            elif rng.random() < (0.2 if c.ext[s] == 0 else 0.7):
                grow[s] = rng.choice([1, 1, 1, 1, 0, rng.randint(2, 700)])
        if grow:
            kinds.update(k for k, *_ in c.ubatch(grow))
    return kinds


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n_stream,kv,cap", [(4, 2048, 4 * 512), (8, 1024, 3 * 1024), (3, 4096, 3 * 768)])
def test_random_load_keeps_every_cell_where_its_window_says(sim_lib, seed, n_stream, kv, cap):
    """Every step of a random load checked (Cache.check), and the load made the policy use every kind of move."""
    c = new_cache(sim_lib, n_stream, kv, cap)
    kinds = random_load(c, random.Random(seed * 1000 + n_stream), 800)
    assert kinds == {DEMOTE, RELOCATE, PROMOTE}, kinds
    c.close()


@pytest.mark.parametrize("drop", [DEMOTE, RELOCATE, PROMOTE])
def test_a_missing_copy_is_caught(sim_lib, drop):
    """Control: the checks see a copy list with one kind of copy left out."""
    c = new_cache(sim_lib, 4, 2048, 4 * 512, drop=drop)
    with pytest.raises(AssertionError, match="stream .* cell"):
        random_load(c, random.Random(7), 800)
    c.close()
