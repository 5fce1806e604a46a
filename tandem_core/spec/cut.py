"""StairCut: how much of the drafted tree to verify, on the measured price of a verify.

Each round the drafters' merged tree is cut to the node set that maximises

    E[tokens this round] / price(rows)  =  (1 + sum of kept nodes' acceptance) / price(base_rows + k, L)

where a node's acceptance is the calibrated chance that it is on the accepted
path, ``k`` the kept nodes and ``L`` the context length. For each ``k`` the
nodes are taken best-first on acceptance (a node only after its parent, so
every candidate set is a tree), the ratio is evaluated for every ``k`` from 0
(plain decode) to ``max_tree``, and the best wins (``cut``; the loop's ``cut_round`` explores
after a run of rounds that kept nothing, see ``StairCut``). The name: on a GPU the price
of a verify is a staircase in its width (flat within a tile, a step at the
next), so the best cut often sits just below a step.

The price comes from a price file written by the benchmark (``PriceTable``,
``tandem_core/shipped/prices/<model>/<profile>.<device>.json``) or, without one, is learned
online from the loop's own measured verify times (``OnlinePrices``). The
acceptance comes from the drafters' probabilities, calibrated online against
what the walk accepted (``Calibration``, one monotone curve per source).

Price file format (JSON, ``"format": "tandem-prices"``, ``"version": 1``)::

    {
      "format": "tandem-prices", "version": 1,
      "model": "qwen3.8-27b", "profile": "bf16", "device": "h200",
      "widths":   [1, 2, 3, 4, 6, 8, 12, 16, 24, 32],      # rows per verify forward, ascending, >= 1
      "contexts": [512, 4096, 16384, 32768],               # context lengths L, ascending, >= 0
      "ms": [[...], ...],                                   # [len(contexts)][len(widths)] verify ms, > 0
      "meta": {"tool": "...", "repeats": 20, "commit": "..."}   # free-form, optional
    }

``ms[c][w]`` is the median wall time of one verify forward of ``widths[w]`` rows
on top of ``contexts[c]`` cached tokens. Between grid points the price is linear
in both; below the first context it is the first context's; beyond the last
context it continues the last segment's slope; each row is made non-decreasing
in width; a width beyond the last measured one is priced infinite (the cut
never verifies wider than what was measured).
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np

from tandem_core.spec.tree import TokenTree

__all__ = [
    "PRICE_FORMAT", "PRICE_VERSION", "PriceFileError", "PriceTable", "OnlinePrices", "Calibration",
    "CutResult", "StairCut", "price_file_path", "find_price_file",
]

PRICE_FORMAT = "tandem-prices"
PRICE_VERSION = 1


class PriceFileError(ValueError):
    """A price file that is malformed (the message names the file and the field)."""


# -- prices from a file --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PriceTable:
    """A measured grid of verify prices (see the module docstring for the file format)."""

    widths: tuple[int, ...]
    contexts: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]   # [C][W]
    meta: dict[str, Any] = field(default_factory=dict)
    where: str = "<memory>"

    def __post_init__(self) -> None:
        w, c, m = self.widths, self.contexts, self.ms
        if not w or any(x < 1 for x in w) or any(b <= a for a, b in zip(w, w[1:])):
            raise PriceFileError(f"{self.where}: 'widths' must be ascending integers >= 1, got {list(w)}")
        if not c or any(x < 0 for x in c) or any(b <= a for a, b in zip(c, c[1:])):
            raise PriceFileError(f"{self.where}: 'contexts' must be ascending integers >= 0, got {list(c)}")
        if len(m) != len(c) or any(len(row) != len(w) for row in m):
            raise PriceFileError(f"{self.where}: 'ms' must be {len(c)} rows (contexts) of {len(w)} (widths)")
        for ci, row in enumerate(m):
            for wi, v in enumerate(row):
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                    raise PriceFileError(f"{self.where}: ms[{ci}][{wi}] (context {c[ci]}, width {w[wi]}) "
                                         f"is {v!r}, not a positive number")

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "<memory>") -> "PriceTable":
        if d.get("format") != PRICE_FORMAT:
            raise PriceFileError(f"{where}: 'format' is {d.get('format')!r}, expected {PRICE_FORMAT!r}")
        if d.get("version") != PRICE_VERSION:
            raise PriceFileError(f"{where}: 'version' is {d.get('version')!r}, "
                                 f"this reader knows {PRICE_VERSION}")
        for key in ("widths", "contexts", "ms"):
            if not isinstance(d.get(key), list):
                raise PriceFileError(f"{where}: {key!r} is missing or not a list")
        meta = {k: v for k, v in d.items() if k not in ("format", "version", "widths", "contexts", "ms")}
        try:
            return cls(tuple(int(x) for x in d["widths"]), tuple(int(x) for x in d["contexts"]),
                       tuple(tuple(row) for row in d["ms"]), meta, where)
        except TypeError as exc:
            raise PriceFileError(f"{where}: 'ms' must be a list of lists of numbers ({exc})") from exc

    @classmethod
    def load(cls, path: str | Path) -> "PriceTable":
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise PriceFileError(f"{p}: not valid JSON ({exc})") from exc
        if not isinstance(d, dict):
            raise PriceFileError(f"{p}: not a JSON object")
        return cls.from_dict(d, str(p))

    def to_dict(self) -> dict[str, Any]:
        return {"format": PRICE_FORMAT, "version": PRICE_VERSION, **self.meta, "widths": list(self.widths),
                "contexts": list(self.contexts), "ms": [list(r) for r in self.ms]}

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def curve(self, context_len: int, n_max: int) -> np.ndarray:
        """[n_max] float64: the price in ms of a verify of ``n`` rows (index ``n - 1``) at ``context_len``."""
        ctx = np.asarray(self.contexts, dtype=np.float64)
        ms = np.asarray(self.ms, dtype=np.float64)             # [C, W]
        L = float(context_len)
        if len(ctx) == 1 or L <= ctx[0]:
            row = ms[0] if L <= ctx[0] else ms[-1]
        elif L >= ctx[-1]:
            slope = np.maximum((ms[-1] - ms[-2]) / (ctx[-1] - ctx[-2]), 0.0)
            row = ms[-1] + slope * (L - ctx[-1])
        else:
            j = int(np.searchsorted(ctx, L, side="right")) - 1
            t = (L - ctx[j]) / (ctx[j + 1] - ctx[j])
            row = ms[j] * (1.0 - t) + ms[j + 1] * t
        row = np.maximum.accumulate(row)
        n = np.arange(1, n_max + 1, dtype=np.float64)
        w = np.asarray(self.widths, dtype=np.float64)
        out = np.interp(n, w, row)
        out[n > w[-1]] = np.inf
        return out

    def price(self, n: int, context_len: int) -> float:
        return float(self.curve(context_len, n)[n - 1])


def price_file_path(root: str | Path, model: str, profile: str, device: str) -> Path:
    """``<root>/prices/<model>/<profile>.<device>.json`` (``root`` holds ``models/`` and ``prices/``)."""
    return Path(root) / "prices" / model / f"{profile}.{device}.json"


def find_price_file(model: str, profile: str, device: str,
                    dirs: Iterable[str | Path] | None = None) -> Path | None:
    """The first price file for ``(model, profile, device)`` in ``dirs`` (default: ``TANDEM_REGISTRY``, then
    every folder registered through ``tandem_model_entries``), or None."""
    if dirs is None:
        from tandem_core.plugins import registries
        from tandem_core.settings import SETTINGS

        extra = str(SETTINGS.get("REGISTRY"))
        dirs = ([Path(extra).expanduser()] if extra else []) + [Path(p) for p in registries().model_entries]
    for d in dirs:
        p = price_file_path(d, model, profile, device)
        if p.is_file():
            return p
    return None


# -- prices learned online -----------------------------------------------------------------------------


def _pav(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted isotonic (non-decreasing) regression by pool-adjacent-violators. [M] -> [M]."""
    if len(values) < 2 or bool(np.all(values[1:] >= values[:-1])):
        return values
    means: list[float] = []
    wsum: list[float] = []
    sizes: list[int] = []
    for v, w in zip(values.tolist(), weights.tolist()):
        means.append(v)
        wsum.append(w)
        sizes.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            v2, w2, c2 = means.pop(), wsum.pop(), sizes.pop()
            tw = wsum[-1] + w2
            means[-1] = (means[-1] * wsum[-1] + v2 * w2) / tw
            wsum[-1] = tw
            sizes[-1] += c2
    return np.repeat(np.asarray(means), sizes)


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value at which half the weight lies on either side (the plain median when no weight is positive)."""
    if not np.any(weights > 0):
        return float(np.median(values))
    order = np.argsort(values)
    v, w = values[order], weights[order]
    cum = np.cumsum(w)
    return float(v[int(np.searchsorted(cum, 0.5 * cum[-1]))])


class OnlinePrices:
    """Verify prices learnt from measurements: one robust line ``ms = a + b * L`` per width.

    ``observe(n, L, ms)`` keeps the last ``window`` samples of width ``n`` and refits
    that width's line (Theil-Sen: the median of pairwise slopes, then the median
    intercept; robust to a stray slow round). A width whose samples span too little
    context to say borrows the shared slope: the median of the widths' own slopes,
    weighted by the context each spans. A line holds only over the contexts its width
    was measured at: beyond them the price follows the shared slope from the nearest
    end (three samples over 20 tokens give a slope that must not be carried 500
    tokens away). ``curve(L, n_max)`` evaluates the lines at ``L``, makes them
    non-decreasing in width (weighted isotonic regression), interpolates linearly
    between measured widths and extrapolates beyond them along the measured trend
    (below the narrowest and with nothing measured: the prior
    ``1 + prior_slope * (n - 1)``, relative).
    """

    def __init__(self, window: int = 64, prior_slope: float = 0.05) -> None:
        self.window = window
        self.prior_slope = prior_slope
        self._buf: dict[int, np.ndarray] = {}       # width -> [window, 2] (context, ms) ring
        self._count: dict[int, int] = {}            # width -> samples seen
        self._fits: dict[int, tuple[float, float, float, float, float]] = {}  # width -> (intercept, slope
        #                                                     or nan, median L, least L, largest L)
        self._dirty: set[int] = set()
        self._version = 0
        self._lines: tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                           float] | None = None
        self._cache: tuple[tuple[int, int, int], np.ndarray] | None = None

    def observe(self, n: int, context_len: int, ms: float) -> None:
        if n < 1 or not math.isfinite(ms) or ms <= 0:
            return
        n = int(n)
        buf = self._buf.get(n)
        if buf is None:
            buf = self._buf[n] = np.zeros((self.window, 2))
            self._count[n] = 0
        buf[self._count[n] % self.window] = (float(context_len), float(ms))
        self._count[n] += 1
        self._dirty.add(n)
        self._version += 1

    @property
    def widths(self) -> tuple[int, ...]:
        """The widths measured so far."""
        return tuple(sorted(self._buf))

    def samples(self, n: int) -> int:
        """Samples of width ``n`` held (at most ``window``)."""
        return min(self._count.get(n, 0), self.window)

    def _fit(self, n: int) -> tuple[float, float, float, float, float]:
        """Width ``n``'s line: a Theil-Sen-style slope (the median of the slopes between the samples of the
        lower and the upper half of the contexts) and the median intercept; nan slope when the samples'
        contexts are too close together to tell; and the median, least and largest context sampled."""
        m = self.samples(n)
        arr = self._buf[n][:m]
        order = np.argsort(arr[:, 0])
        L, y = arr[order, 0], arr[order, 1]
        Lmed, Lmin, Lmax = float(L[m // 2]), float(L[0]), float(L[-1])
        h = m // 2
        if m < 3 or L[-1] - L[0] < 0.05 * max(Lmed, 1.0):
            return float(np.median(y)), math.nan, Lmed, Lmin, Lmax
        dL = L[m - h:] - L[:h]
        ok = dL > 1e-9
        if not ok.any():
            return float(np.median(y)), math.nan, Lmed, Lmin, Lmax
        slope = max(float(np.median((y[m - h:] - y[:h])[ok] / dL[ok])), 0.0)
        return float(np.median(y - slope * L)), slope, Lmed, Lmin, Lmax

    def _line_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                    float]:
        """(widths, intercepts at L = 0, slopes, sample counts, least and largest contexts sampled, the shared
        slope), slopes filled in; refit per observation."""
        if self._lines is None or self._lines[0] != self._version:
            for w in self._dirty:
                self._fits[w] = self._fit(w)
            self._dirty.clear()
            widths = sorted(self._fits)
            a, b, Lmed, Lmin, Lmax = np.asarray([self._fits[w] for w in widths], dtype=np.float64).T
            known = ~np.isnan(b)
            shared = _weighted_median(b[known], (Lmax - Lmin)[known]) if known.any() else 0.0
            # a width without its own slope: its median price sits at its samples' median context
            a = np.where(known, a, a - shared * Lmed)
            b = np.where(known, b, shared)
            counts = np.minimum(np.asarray([self._count[w] for w in widths], dtype=np.float64), self.window)
            self._lines = (self._version, np.asarray(widths, dtype=np.float64), a, b, counts, Lmin, Lmax, shared)
        return self._lines[1:]

    def curve(self, context_len: int, n_max: int) -> np.ndarray:
        """[n_max] float64: estimated ms of a verify of ``n`` rows (index ``n - 1``) at ``context_len``."""
        key = (self._version, int(context_len), int(n_max))
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        n = np.arange(1, n_max + 1, dtype=np.float64)
        prior = 1.0 + self.prior_slope * (n - 1.0)
        if not self._buf:
            out = prior
        else:
            wv, a, b, counts, Lmin, Lmax, shared = self._line_arrays()
            L = float(context_len)
            Lc = np.clip(L, Lmin, Lmax)                      # each line where it was measured, then the shared slope
            ev = _pav(np.maximum(a + b * Lc + shared * (L - Lc), 1e-6), counts)
            out = np.interp(n, wv, ev)
            lo = n < wv[0]
            out[lo] = ev[0] * prior[lo] / (1.0 + self.prior_slope * (wv[0] - 1.0))
            hi = n > wv[-1]
            if hi.any():
                if len(wv) >= 2:
                    trend = (ev[-1] - ev[0]) / (wv[-1] - wv[0])
                else:
                    trend = self.prior_slope * ev[0] / (1.0 + self.prior_slope * (wv[0] - 1.0))
                out[hi] = ev[-1] + max(trend, 0.0) * (n[hi] - wv[-1])
        self._cache = (key, out)
        return out

    def price(self, n: int, context_len: int) -> float:
        return float(self.curve(context_len, n)[n - 1])


# -- acceptance calibration ----------------------------------------------------------------------------


class Calibration:
    """Per-source calibration of drafted probabilities against what was accepted.

    Each source keeps ``bins`` equal bins over [0, 1] of (accepted, seen) counts,
    forgotten by ``decay`` at each batch so the curve follows a drifting drafter,
    and starts from ``prior`` pseudo-observations at the bin's centre (no data:
    the identity). The curve is the bins' rates made non-decreasing (weighted
    isotonic regression), read by linear interpolation between bin centres. A
    source never observed maps through unchanged.
    """

    def __init__(self, bins: int = 20, prior: float = 4.0, decay: float = 0.998) -> None:
        self.bins = bins
        self.prior = prior
        self.decay = decay
        self.centres = (np.arange(bins) + 0.5) / bins
        self._acc: dict[str, np.ndarray] = {}
        self._seen: dict[str, np.ndarray] = {}
        self._curves: dict[str, np.ndarray] = {}

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(sorted(self._seen))

    def observe(self, probs: Sequence[float], accepted: Sequence[bool], sources: Sequence[str]) -> None:
        """One batch of drafted nodes whose parent was accepted: probability, accepted or not, source."""
        if not len(probs):
            return
        p = np.clip(np.asarray(probs, dtype=np.float64), 0.0, 1.0)
        a = np.asarray(accepted, dtype=np.float64)
        src = np.asarray(sources, dtype=object)
        b = np.minimum((p * self.bins).astype(np.int64), self.bins - 1)
        for s in set(src.tolist()):
            sel = src == s
            acc = self._acc.setdefault(s, np.zeros(self.bins))
            seen = self._seen.setdefault(s, np.zeros(self.bins))
            acc *= self.decay
            seen *= self.decay
            np.add.at(acc, b[sel], a[sel])
            np.add.at(seen, b[sel], 1.0)
            self._curves.pop(s, None)

    def curve(self, source: str) -> np.ndarray:
        """[bins] the calibrated acceptance at each bin centre (identity for an unseen source)."""
        c = self._curves.get(source)
        if c is None:
            if source not in self._seen:
                return self.centres
            acc, seen = self._acc[source], self._seen[source]
            rate = (acc + self.prior * self.centres) / (seen + self.prior)
            c = _pav(rate, seen + self.prior)
            self._curves[source] = c
        return c

    def __call__(self, source: str, probs: np.ndarray | Sequence[float]) -> np.ndarray:
        p = np.asarray(probs, dtype=np.float64)
        if source not in self._seen:
            return np.clip(p, 0.0, 1.0)
        return np.interp(p, self.centres, self.curve(source))


# -- the cut -------------------------------------------------------------------------------------------


class CutResult(NamedTuple):
    """The cut: the kept tree (reindexed), which input nodes it keeps, and what the cut expects of it."""

    tree: TokenTree
    keep: tuple[int, ...]     # ascending indices into the input tree; ``tree`` is ``input.subtree(keep)``
    expected: float           # E[accepted + 1]: tokens the round is expected to yield
    price_ms: float           # the price of verifying it (base_rows + len(keep) rows)
    rate: float               # expected / price_ms, tokens per ms


class StairCut:
    """Cuts merged trees; learns prices and acceptance from what the loop reports.

    prices      a ``PriceTable`` (from the benchmark's file), or None to learn prices online
    max_tree    the most drafted nodes one cut keeps
    base_rows   rows every verify forward carries besides the drafted nodes: 1 when the loop
                forwards the model's own token of the last round together with the tree (k = 0
                is then plain decode), 0 when it forwards only drafted nodes
    online      the online price learner (used when ``prices`` is None; fed by ``observe`` always)
    calibration the acceptance calibration

    explore_every  after this many loop rounds in a row whose cut kept nothing of a drafted tree, the
                next round verifies the best cut that keeps something (0: never)

    The loop calls, each round: ``cut_round(tree, L)``; after the verify, ``observe(rows, L, ms)``
    with the rows the forward carried and its measured time; after the walk,
    ``observe_walk(cut.tree, result.path_nodes)``. ``cut`` is the same choice without the
    exploration and without state.

    Why explore: a cut that keeps nothing teaches nothing. The calibration learns only from
    verified nodes and the online prices only from verified widths, so a drafter whose calibrated
    acceptance once fell, or a width whose one measurement met a slow moment, would never be
    verified again, whatever the drafter does later. One widened round in ``explore_every + 1``
    keeps both measured; its cost is bounded by that share of one round's extra rows. The wait does
    not grow after explorations that found nothing: an agent's turn can switch from prose to copying
    a file at any moment, and a longer wait would miss it (a doubling wait capped at 256 rounds took
    700 to 800 rounds to trust a drafter that turned good after 1,300 misses again, against 300 at a
    fixed 16), while the fixed wait costs one extra row in 17 rounds: a few percent on a CPU, nothing
    measurable on a GPU, where two rows cost what one does.
    """

    def __init__(self, prices: PriceTable | None = None, *, max_tree: int = 64, base_rows: int = 1,
                 online: OnlinePrices | None = None, calibration: Calibration | None = None,
                 explore_every: int = 16) -> None:
        if max_tree < 0 or base_rows < 0 or explore_every < 0:
            raise ValueError(f"StairCut: max_tree ({max_tree}), base_rows ({base_rows}) and explore_every "
                             f"({explore_every}) must be >= 0")
        self.table = prices
        self.max_tree = max_tree
        self.base_rows = base_rows
        self.online = online if online is not None else OnlinePrices()
        self.calibration = calibration if calibration is not None else Calibration()
        self.explore_every = explore_every
        self.explored = 0             # rounds whose cut was widened to explore
        self._idle = 0                # rounds in a row whose cut kept nothing of a drafted tree

    @classmethod
    def for_model(cls, model: str, profile: str, device: str, *, dirs: Iterable[str | Path] | None = None,
                  **kw: Any) -> "StairCut":
        """With the model's price file for this profile and device when there is one, else learning online."""
        path = find_price_file(model, profile, device, dirs)
        return cls(PriceTable.load(path) if path is not None else None, **kw)

    @property
    def learning_prices(self) -> bool:
        return self.table is None

    # -- what the loop reports --------------------------------------------------------------------

    def observe(self, n_nodes: int, context_len: int, ms: float) -> None:
        """A verify forward of ``n_nodes`` rows (drafted nodes plus ``base_rows``) at ``context_len``
        took ``ms``."""
        self.online.observe(n_nodes, context_len, ms)

    def observe_accept(self, node_probs: Sequence[float], accepted_mask: Sequence[bool],
                       sources: Sequence[str]) -> None:
        """Calibration data: drafted nodes whose parent was accepted, each with its source's probability."""
        self.calibration.observe(node_probs, accepted_mask, sources)

    def observe_walk(self, tree: TokenTree, path_nodes: Sequence[int]) -> None:
        """Calibrate from one walk: every node of ``tree`` whose parent was accepted (or is the root) is a
        trial for each of its sources, a success when the node itself was accepted."""
        on_path = set(path_nodes)
        probs: list[float] = []
        acc: list[bool] = []
        srcs: list[str] = []
        for i, par in enumerate(tree.parents):
            if par < 0 or par in on_path:
                for s, p in zip(tree.sources[i], tree.source_probs[i]):
                    probs.append(p)
                    acc.append(i in on_path)
                    srcs.append(s)
        self.observe_accept(probs, acc, srcs)

    # -- the estimate -----------------------------------------------------------------------------

    def curve(self, context_len: int, n_max: int) -> np.ndarray:
        """[n_max] ms of a verify of ``n`` rows (index ``n - 1``): the price file's, or the learnt one."""
        src = self.table if self.table is not None else self.online
        return src.curve(context_len, n_max)

    def acceptance(self, tree: TokenTree) -> np.ndarray:
        """[N] calibrated chance that each node is on the accepted path.

        A node's conditional acceptance is the largest calibrated probability over its
        sources; siblings are exclusive, so a parent's children are scaled to sum to
        at most 1; the path product gives the node's acceptance.
        """
        n = len(tree)
        if n == 0:
            return np.zeros(0)
        cond = np.zeros(n)
        by_source: dict[str, tuple[list[int], list[float]]] = {}
        for i, (srcs, ps) in enumerate(zip(tree.sources, tree.source_probs)):
            for s, p in zip(srcs, ps):
                idx, vals = by_source.setdefault(s, ([], []))
                idx.append(i)
                vals.append(p)
        for s, (idx, vals) in by_source.items():
            np.maximum.at(cond, np.asarray(idx), self.calibration(s, vals))
        par = np.asarray(tree.parents) + 1                      # 0: the root
        sums = np.bincount(par, weights=cond, minlength=n + 1)
        cond = cond / np.maximum(sums[par], 1.0)
        acc = cond.tolist()
        for i, p in enumerate(tree.parents):
            if p >= 0:
                acc[i] *= acc[p]
        return np.asarray(acc)

    def cut(self, tree: TokenTree, context_len: int, max_tree: int | None = None) -> CutResult:
        """The node set (closed under ancestors) with the best expected tokens per ms."""
        return self._choose(tree, context_len, max_tree, explore=False)

    def cut_round(self, tree: TokenTree, context_len: int, max_tree: int | None = None) -> CutResult:
        """The cut a loop round verifies: ``cut``'s, except that after ``explore_every`` rounds in a row
        whose cut kept nothing of a drafted tree, the best cut that keeps at least one node."""
        explore = 0 < self.explore_every <= self._idle
        r = self._choose(tree, context_len, max_tree, explore=explore)
        if r.keep:
            self.explored += int(explore)
            self._idle = 0
        elif len(tree) and (self.max_tree if max_tree is None else max_tree) > 0:
            self._idle += 1
        return r

    def _choose(self, tree: TokenTree, context_len: int, max_tree: int | None, *, explore: bool) -> CutResult:
        limit = self.max_tree if max_tree is None else max_tree
        k_max = min(len(tree), max(limit, 0))
        acc = self.acceptance(tree)
        order = _best_first(tree, acc, k_max)
        gains = np.concatenate([[1.0], 1.0 + np.cumsum(acc[order])]) if order else np.ones(1)
        rows = np.maximum(self.base_rows + np.arange(len(order) + 1), 1)
        price = self.curve(context_len, int(rows[-1]))[rows - 1]
        rate = gains / price
        if explore and len(order) and np.isfinite(price[1:]).any():
            k = 1 + int(np.argmax(rate[1:]))
        else:
            k = int(np.argmax(rate))
        keep = tuple(sorted(order[:k]))
        return CutResult(tree.subtree(keep), keep, float(gains[k]), float(price[k]), float(rate[k]))


def _best_first(tree: TokenTree, acc: np.ndarray, k_max: int) -> list[int]:
    """Up to ``k_max`` nodes in best-first order of acceptance, each after its parent."""
    kids = tree.children
    heap = [(-float(acc[c]), c) for c in kids[-1]]
    heapq.heapify(heap)
    out: list[int] = []
    while heap and len(out) < k_max:
        _, i = heapq.heappop(heap)
        out.append(i)
        for c in kids[i]:
            heapq.heappush(heap, (-float(acc[c]), c))
    return out
