"""Fitting and scoring primitives shared by the turn-level and the item-level (propensity) probes.

Pure functions: arrays in, numbers out. Folds are grouped by item so no item sits on both sides of a split.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.sparse import csr_matrix, hstack
from scipy.stats import rankdata, spearmanr
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import GroupKFold, StratifiedGroupKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from mechprobe.errors import UserError


class InsufficientPositives(UserError, ValueError):
    """Not enough positive examples (or items) for grouped cross-validation to mean anything."""


CS: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 1.0)


Folds = list[tuple[np.ndarray, np.ndarray]]


@dataclass
class Metric:
    """A point estimate with a 95% interval (bootstrap over items unless the field says otherwise)."""

    value: float
    lo: float
    hi: float

    def fmt(self) -> str:
        return f"{self.value:.3f} [{self.lo:.3f}, {self.hi:.3f}]"


def fold_counts(y: np.ndarray, folds: Folds, groups: np.ndarray | None = None) -> list[dict[str, int]]:
    """Class (and item) counts per fold, for the metrics file: a reader can see what each AUROC rests on."""
    out = []
    for tr, te in folds:
        c = {"train_pos": int(y[tr].sum()), "train_neg": int(len(tr) - y[tr].sum()),
             "test_pos": int(y[te].sum()), "test_neg": int(len(te) - y[te].sum())}
        if groups is not None:
            c["test_items"] = len(set(groups[te]))
        out.append(c)
    return out


def thin_data_hint(n_items: int, n_splits: int, fewer_folds: int | None) -> str:
    """What to do about data too thin to fit: more items or samples, and fewer folds only where that helps.

    ``fewer_folds`` is the largest fold count the data could support (None when the fold count is not what
    failed, e.g. too few positive rows in all); it is suggested only if it is at least 2 and below ``n_splits``.
    """
    hint = (f"Add items to the run (limit={max(2 * n_items, n_items + 10)}) or probe more samples per item "
            "(a new run with samples=, temperatures=0 1.0)")
    if fewer_folds is not None and 2 <= fewer_folds < n_splits:
        return hint + f", or use fewer folds (folds={fewer_folds})."
    return hint + "."


def make_folds(y: Sequence[int] | np.ndarray, groups: Sequence[str] | np.ndarray, n_splits: int = 5, seed: int = 0,
               min_pos: int = 5, min_test_pos: int = 2) -> Folds:
    """Item-grouped stratified outer folds, refusing data too thin to give a meaningful AUROC."""
    y = np.asarray(y).astype(int)
    groups = np.asarray(groups)
    n_pos, n_neg = int(y.sum()), int(len(y) - y.sum())
    pos_items = len(set(groups[y == 1]))
    n_items = len(set(groups))
    if n_pos < min_pos or n_neg < min_pos or pos_items < n_splits:
        # Class counts do not depend on the fold count; too few positive items for the folds does.
        fewer = pos_items if n_pos >= min_pos and n_neg >= min_pos else None
        raise InsufficientPositives(
            f"insufficient positives: {n_pos} positive rows from {pos_items} items and {n_neg} negative rows; "
            f"need at least {min_pos} rows of each class and {n_splits} items with a positive for "
            f"{n_splits}-fold grouped CV. {thin_data_hint(n_items, n_splits, fewer)}")
    if n_items < n_splits:
        raise InsufficientPositives(f"only {n_items} items for {n_splits} folds. "
                                    f"{thin_data_hint(n_items, n_splits, n_items)}")
    skf = StratifiedGroupKFold(n_splits=n_splits, shuffle=True, random_state=seed)
    folds = []
    for k, (tr, te) in enumerate(skf.split(np.zeros(len(y)), y, groups)):
        if y[te].sum() < min_test_pos or (1 - y[te]).sum() < 1:
            raise InsufficientPositives(
                f"insufficient positives: test fold {k} holds {int(y[te].sum())} positive and "
                f"{int((1 - y[te]).sum())} negative rows (need >= {min_test_pos} positive rows per fold). "
                f"{thin_data_hint(n_items, n_splits, n_splits - 1)}")
        if set(groups[tr]) & set(groups[te]):  # a real check, not an assert: must survive python -O
            raise RuntimeError("grouped folds leaked an item into both train and test")
        folds.append((tr, te))
    return folds


def _inner_splits(y: np.ndarray, g: np.ndarray, seed: int, n_inner: int = 3) -> Folds:
    """Grouped (and, when possible, stratified) inner splits with both classes on each side."""
    n = min(n_inner, len(set(g[y == 1])), len(set(g[y == 0])))
    if n < 2:
        return []
    try:
        splits = list(StratifiedGroupKFold(n_splits=n, shuffle=True, random_state=seed).split(y, y, g))
    except ValueError:
        splits = list(GroupKFold(n_splits=n).split(y, y, g))
    return [(tr, va) for tr, va in splits if len(set(y[tr])) == 2 and len(set(y[va])) == 2]


def _logreg(c: float = 1.0, seed: int = 0) -> Any:
    # class_weight="balanced": positives are rare, and an unweighted fit would mostly learn the prior.
    return make_pipeline(StandardScaler(), LogisticRegression(C=c, max_iter=2000, class_weight="balanced",
                                                              random_state=seed))


@dataclass
class LogregFit:
    model: Any
    c: float
    inner_auroc: float  # mean grouped inner-CV AUROC at the chosen C (0.5 when no inner CV was possible)


def fit_logreg(x: np.ndarray, y: np.ndarray, groups: np.ndarray, seed: int = 0, cs: Sequence[float] = CS
               ) -> LogregFit:
    """StandardScaler + logistic regression, C chosen by grouped inner CV on these rows only, then refit.

    Hand-rolled rather than ``LogisticRegressionCV`` because the scaler must be refitted inside every
    inner split and the inner splits must be grouped; the grid is small, so the cost is the same.
    """
    y = np.asarray(y).astype(int)
    splits = _inner_splits(y, groups, seed)
    best_c, best = cs[len(cs) // 2], 0.5
    if splits:
        best = -1.0
        for c in cs:
            vals = []
            for tr, va in splits:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    m = _logreg(c, seed).fit(x[tr], y[tr])
                vals.append(auroc(y[va], m.decision_function(x[va])))
            if np.mean(vals) > best + 1e-12:
                best, best_c = float(np.mean(vals)), c
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _logreg(best_c, seed).fit(x, y)
    return LogregFit(model, float(best_c), float(best))


def random_directions(d: int, n: int, seed: int = 0) -> np.ndarray:
    """``[d, n]`` Gaussian directions from a stream of their own (a plain ``default_rng(seed)`` would
    reproduce any vector a user drew with the same seed: the synthetic tests caught exactly that)."""
    return np.random.default_rng([seed, 0x5EED]).standard_normal((d, n))


def _dom(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return x[y == 1].mean(0) - x[y == 0].mean(0)


def random_direction_band(x: np.ndarray, y: np.ndarray, folds: Folds, n_dirs: int = 200, seed: int = 0,
                          score: str = "auroc") -> Metric:
    """The score of projections on ``n_dirs`` random directions, each signed on its training fold.

    One random direction is a single draw whose score can sit far from chance; the spread over many
    directions is the reference a learned direction has to beat. ``score="auroc"`` (binary ``y``, sign from
    the class means) serves the turn-level probe, ``score="spearman"`` (continuous ``y``, sign from the
    training rank correlation) the item-level propensity probe.

    Returns:
        Mean and 2.5/97.5 percentiles over directions (not a bootstrap).
    """
    r = random_directions(x.shape[1], n_dirs, seed)
    if score == "spearman":
        s = signed_scores(x @ r, y, folds)
        vals = score_rho_rows(np.broadcast_to(y, (n_dirs, len(y))), s.T)
        vals = vals[np.isfinite(vals)]
        if not len(vals):
            return Metric(float("nan"), float("nan"), float("nan"))
    elif score == "auroc":
        y = np.asarray(y).astype(int)
        s = np.zeros((len(y), n_dirs))
        for tr, te in folds:
            p = x[tr] @ r
            sign = np.where(p[y[tr] == 1].mean(0) >= p[y[tr] == 0].mean(0), 1.0, -1.0)
            s[te] = (x[te] @ r) * sign
        vals = weighted_auroc(y, s.T, np.ones((n_dirs, len(y))), per_row_scores=True)
    else:
        raise ValueError(f"score must be 'auroc' or 'spearman', not {score!r}")
    return Metric(float(vals.mean()), float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5)))


def auroc(y: np.ndarray, s: np.ndarray) -> float:
    """Plain AUROC (ties count half): ``sklearn.metrics.roc_auc_score``; NaN when ``y`` has one class."""
    y = np.asarray(y).astype(int)
    if len(np.unique(y)) < 2:
        return float("nan")
    return float(roc_auc_score(y, np.asarray(s, float)))


def weighted_auroc(y: np.ndarray, s: np.ndarray, w: np.ndarray, per_row_scores: bool = False) -> np.ndarray:
    """AUROC under row weights ``w [B, n]`` (one AUROC per weight row), ties counted half.

    An item bootstrap is exactly a weighting: an item drawn k times weighs k. Doing it as weights lets
    all draws share one sort, so 1000 draws cost about as much as one sklearn call.
    With ``per_row_scores`` ``s`` is ``[B, n]`` too (used for many random directions at once).
    """
    y = np.asarray(y).astype(float)
    if per_row_scores:
        return np.array([weighted_auroc(y, s[b], w[b:b + 1])[0] for b in range(len(s))])
    order = np.argsort(s, kind="mergesort")
    ss, ys, ws = s[order], y[order], w[:, order]
    starts = np.flatnonzero(np.r_[True, ss[1:] != ss[:-1]])
    gp = np.add.reduceat(ws * ys, starts, axis=1)
    gn = np.add.reduceat(ws * (1 - ys), starts, axis=1)
    below = np.cumsum(gn, axis=1) - gn
    num = (gp * (below + 0.5 * gn)).sum(1)
    den = gp.sum(1) * gn.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def _weighted_bal_acc(y: np.ndarray, s: np.ndarray, w: np.ndarray) -> np.ndarray:
    pred = s > 0
    wp, wn = (w * y).sum(1), (w * (1 - y)).sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpr = (w * (y * pred)).sum(1) / wp
        tnr = (w * ((1 - y) * ~pred)).sum(1) / wn
        return np.where((wp > 0) & (wn > 0), (tpr + tnr) / 2, np.nan)


def item_bootstrap_weights(groups: Sequence[str] | np.ndarray, n_boot: int, seed: int = 0) -> np.ndarray:
    """``[n_boot, n]`` row weights of an item bootstrap (each item drawn with replacement).

    Same seed -> same draws, so curves over layers are compared on paired resamples.
    """
    _, inv = np.unique(np.asarray(groups), return_inverse=True)
    n_items = inv.max() + 1
    counts = np.random.default_rng(seed).multinomial(n_items, np.full(n_items, 1.0 / n_items), size=n_boot)
    return counts[:, inv].astype(float)


def grouped_bootstrap(y: np.ndarray, s: np.ndarray, groups: Sequence[str] | np.ndarray, metric: str = "auroc",
                      n_boot: int = 1000, seed: int = 0, weights: np.ndarray | None = None) -> Metric:
    """Point estimate and percentile 95% CI, resampling items (groups) with replacement."""
    y = np.asarray(y).astype(int)
    s = np.asarray(s, float)
    w = item_bootstrap_weights(groups, n_boot, seed) if weights is None else weights
    f = weighted_auroc if metric == "auroc" else _weighted_bal_acc
    if metric not in ("auroc", "bal_acc"):
        raise ValueError(f"metric must be auroc or bal_acc, not {metric!r}")
    point = float(f(y, s, np.ones((1, len(y))))[0])
    vals = f(y, s, w)
    vals = vals[np.isfinite(vals)]
    lo, hi = (np.percentile(vals, [2.5, 97.5]) if len(vals) else (float("nan"), float("nan")))
    return Metric(point, float(lo), float(hi))


def text_baseline_scores(texts: Sequence[str], y: np.ndarray, folds: Folds, seed: int = 0,
                         model: str = "logreg") -> np.ndarray:
    """TF-IDF (word 1-2 grams) + log length of the text, out of fold: no model internals.

    The texts should be what the model saw before the boundary (prompt + assistant response): if surface
    features of that text predict the target as well as the probe does, the probe has shown nothing beyond
    reading the text. ``model="logreg"`` (balanced logistic regression, decision values) for a binary
    label; ``model="ridge"`` (ridge regression) for a continuous target such as the follow-up propensity.
    """
    if model not in ("logreg", "ridge"):
        raise ValueError(f"model must be 'logreg' or 'ridge', not {model!r}")
    texts = list(texts)
    y = np.asarray(y).astype(int) if model == "logreg" else np.asarray(y, float)
    out = np.zeros(len(y))

    def length(idx: np.ndarray) -> Any:
        return csr_matrix(np.log1p([[len(texts[i])] for i in idx]))

    for tr, te in folds:
        vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, max_features=5000)
        try:
            xtr = hstack([vec.fit_transform([texts[i] for i in tr]), length(tr)]).tocsr()
            xte = hstack([vec.transform([texts[i] for i in te]), length(te)]).tocsr()
        except ValueError:  # every term below min_df (tiny runs): length alone
            xtr, xte = length(tr), length(te)
        if model == "ridge":
            out[te] = Ridge(alpha=1.0, random_state=seed).fit(xtr, y[tr]).predict(xte)
        else:
            m = LogisticRegression(max_iter=2000, class_weight="balanced", random_state=seed)
            out[te] = m.fit(xtr, y[tr]).decision_function(xte)
    return out


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, numpy scalars and arrays to plain JSON values; non-finite floats become ``null``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # valid JSON
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    return obj


def _rank_rows(a: np.ndarray) -> np.ndarray:
    return rankdata(a, axis=-1)


def spearman_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman rho row by row of ``[B, n]`` arrays (average ranks for ties); NaN where a row is constant."""
    ra, rb = _rank_rows(np.atleast_2d(a)), _rank_rows(np.atleast_2d(b))
    ra = ra - ra.mean(-1, keepdims=True)
    rb = rb - rb.mean(-1, keepdims=True)
    den = np.sqrt((ra * ra).sum(-1) * (rb * rb).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (ra * rb).sum(-1) / np.where(den > 0, den, 1), np.nan)


def spearman(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> float:
    """Spearman rho (``scipy.stats.spearmanr``), NaN when either side is constant."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    if len(a) < 2 or np.all(a == a[0]) or np.all(b == b[0]):
        return float("nan")
    return float(spearmanr(a, b).statistic)


def score_rho_rows(y: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Spearman rho of scores ``s`` against targets ``y``, row by row, with one convention added: a
    *constant score* (no ranking at all, e.g. a probe on the embedding layer, which is one token at the
    boundary) has rho 0, as an uninformative predictor should, where plain Spearman is undefined. A
    constant *target* stays NaN (nothing to rank)."""
    y, s = np.atleast_2d(y), np.atleast_2d(s)
    r = spearman_rows(y, s)
    flat_s = np.ptp(s, axis=-1) <= 1e-12 * np.maximum(1.0, np.abs(s).max(-1))
    return np.where(flat_s & (np.ptp(y, axis=-1) > 0), 0.0, r)


def signed_scores(f: np.ndarray, y: np.ndarray, folds: Folds) -> np.ndarray:
    """A fixed feature (or ``[n, D]`` features) with its sign fitted on each training fold.

    A learned probe picks its sign too; an unsigned control would be a straw man.
    """
    f = np.asarray(f, float)
    two = f.ndim == 2
    f2 = f if two else f[:, None]
    out = np.zeros_like(f2)
    for tr, te in folds:
        r = np.array([spearman(y[tr], f2[tr, j]) for j in range(f2.shape[1])])
        out[te] = f2[te] * np.where(np.nan_to_num(r) >= 0, 1.0, -1.0)
    return out if two else out[:, 0]
