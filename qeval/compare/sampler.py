"""Sampler-aware divergence: how far apart the two models are *after* llama.cpp's sampler chain.

Raw KLD weighs the whole vocabulary, including the long tail a top-k / top-p sampler never draws
from. Here both distributions of a scored token (reference and candidate, as stored) go through the
same truncation and temperature, and the two sampled distributions are compared:

    TVD          ½ Σ |p_i − q_i| over the union of the two supports: the probability mass that moves
    agreement    1 − TVD = Σ min(p_i, q_i): the chance that a maximal coupling draws the same token
                 from both, i.e. the acceptance rate of speculative decoding with the candidate as
                 draft and the reference as target (the rejection rule accepts with min(1, p/q))
    support      whether the two truncated candidate sets differ as sets of token ids
    greedy       whether the two argmaxes are the same token (temperature 0)

The chain is llama.cpp's default one (llama.cpp as vendored by llama-cpp-python 0.3.36):
`common_params_sampling::samplers` in common/common.h lists penalties, dry, top_n_sigma, top_k,
typ_p, top_p, min_p, xtc, temperature, and `common_sampler_init` in common/sampling.cpp adds them in
that order and ends with `llama_sampler_init_dist`. With the settings a `Sampler` holds (penalties,
DRY, top-n-sigma, typical-p and XTC at their disabled defaults) that is

    top_k  ->  top_p  ->  min_p  ->  temperature  ->  draw

so truncation works on the untempered distribution and temperature only reshapes what survives.
The rules below are those of src/llama-sampler.cpp (the file the issue calls llama-sampling.cpp):

* top_k (`llama_sampler_top_k_impl`): k <= 0 is off; otherwise the k highest logits survive. llama.cpp
  selects them with a partial sort (`llama_token_data_array_partial_sort_inplace`: std::partial_sort,
  or bucket sort + std::sort above 128), which leaves the order of equal logits unspecified, so which
  of several tokens tied at the k-th place survive is up to the standard library. Here ties are
  broken by token id, lower id first, everywhere (top-k boundary, top-p cut, argmax): deterministic,
  and the same rule as the stored top-10 ids and same-top-1.
* top_p (`llama_sampler_top_p_apply`): p >= 1 is off. Softmax over the current candidates (after
  top-k: renormalised over the k survivors; without top-k: the full row), sorted by descending
  probability; keep the smallest prefix whose cumulative probability is >= p, the token that crosses
  p included (`cum_sum >= ctx->p` ... `last_idx = i + 1`), at least one token (min_keep is 0 in
  common's defaults); if rounding never lets the sum reach p, every candidate is kept.
* min_p (`llama_sampler_min_p_apply`): p <= 0 is off; keep the tokens with
  logit >= max_logit + log(p), i.e. p_i >= min_p * p_max; the top token always survives.
* temperature (`llama_sampler_temp_ext_apply` -> `llama_sampler_temp_impl`, dynatemp off): t > 0
  divides the surviving logits by t before the draw's softmax (`llama_sampler_dist_apply`), so the
  sampled distribution is p_i^(1/t) renormalised over the survivors; t <= 0 keeps only the highest
  logit: greedy decoding, a point mass on the argmax.

What is exact and what is not. Everything runs on the stored rows: log p_i = lut[code_i] + const
(qeval.storage.codec), the same decoded distribution every other metric uses, in float64 (llama.cpp
works in float32, so a row whose cumulative mass lands within ~1e-7 of top_p may cut one token
differently there). For temperature 0 the argmax is the store's exact one (top_ids[:, 0], taken from
the float32 logits, ties to the lower id), so greedy agreement equals same-top-1 and greedy TVD is
1 − same-top-1. For t > 0 the ranking is by code (lut is non-decreasing, so code order is the order of
the decoded log-probs) with ties by token id; the code ties logits closer than one code step
(9.2e-5 nats within 4 nats of the top, coarser below), which a top-k or top-p boundary may fall
between.

Speed. Truncation needs only the top of each row, and the code is monotone in log p, so the kernel
selects the top candidates by code, once per row for every sampler: a vectorised pass ORs the high
bytes of each 64-entry block (at least the block's largest high byte), a
counting sort orders the blocks by that bound, and a heap of the N best (code, id) pairs reads blocks
in that order until a block's bound is below the heap's worst code: on real rows a few dozen of
4,096 blocks. N is the largest top_k asked for; a sampler without top_k (top-p or min-p alone)
starts at OPEN_START candidates and grows the set (x8, selecting again) until its cut lies inside
it, exact whatever the row but slower (bench/bench_sampler.py). A sampler that truncates nothing
(only a temperature) is computed over the full row in two passes. Greedy samplers need no kernel.
Measured on Gemma-3-270M rows (262,144 vocab): see bench/results/sampler-amd-epyc.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np

from qeval.compare import stats
from qeval.errors import QevalError
from qeval.storage.store import N_CODES

BLOCK = 64  # entries per block whose OR of high bytes decides whether the selection reads it
OPEN_START = 256  # first candidate count of a sampler without top_k (grown x8 until its cut is inside)


# --------------------------------------------------------------------------------------------------
# the sampler value and its parser
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sampler:
    """llama.cpp sampler settings: temperature (0 = greedy), top_k (0 = off), top_p (1 = off),
    min_p (0 = off). `name` is a preset's name or the canonical settings string."""

    name: str
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def settings(self) -> dict:
        return {"temp": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p}

    @property
    def settings_name(self) -> str:
        """Its canonical settings string, whatever its name: what it computes (a preset and the settings
        string of its values compute the same)."""
        return settings_text(self.temperature, self.top_k, self.top_p, self.min_p)

    def describe(self) -> str:
        """Settings in words, as the text report states them."""
        if self.greedy:
            return "temperature 0 (greedy: argmax)"
        parts = [f"temp {_num(self.temperature)}"]
        parts += [f"top_k {self.top_k}"] if self.top_k > 0 else []
        parts += [f"top_p {_num(self.top_p)}"] if self.top_p < 1.0 else []
        parts += [f"min_p {_num(self.min_p)}"] if self.min_p > 0.0 else []
        return ", ".join(parts) + ("" if self.truncates else " (no truncation)")


def _num(x: float) -> str:
    """The shortest text that reads back as x (0.95, 1, 0.123456789)."""
    return str(int(x)) if x == int(x) else repr(float(x))


PRESETS: dict[str, Sampler] = {s.name: s for s in (
    Sampler(name="greedy", temperature=0.0),
    # Qwen3.5's recommended settings (model card): thinking and non-thinking (instruct) mode
    Sampler(name="qwen3.5-thinking", temperature=0.6, top_k=20, top_p=0.95, min_p=0.0),
    Sampler(name="qwen3.5-instruct", temperature=0.7, top_k=20, top_p=0.8, min_p=0.0),
    # llama.cpp's own defaults, common/common.h common_params_sampling: temp 0.80, top_k 40, top_p 0.95, min_p 0.05
    Sampler(name="llama.cpp-default", temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
)}

_KEYS = {"temp": "temp", "temperature": "temp", "top_k": "top_k", "top-k": "top_k", "top_p": "top_p",
         "top-p": "top_p", "min_p": "min_p", "min-p": "min_p"}
# keys a settings string leaves out are off: temp 1 (no scaling), top_k 0, top_p 1, min_p 0
_OFF = {"temp": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


def _usage(text: str, why: str) -> QevalError:
    return QevalError(
        f"--sampler {text!r}: {why}. Give a preset ({', '.join(PRESETS)}) or settings like "
        "temp=0.6,top_k=20,top_p=0.95,min_p=0 (temp >= 0, 0 = greedy; top_k an integer >= 0, 0 = off; "
        "top_p in [0, 1], 1 = off; min_p in [0, 1], 0 = off; keys left out are off)")


def parse(text: str) -> Sampler:
    """A preset name, or settings `key=value,...` (keys temp, top_k, top_p, min_p; those left out are off).
    A settings string is named by its canonical form, `temp=T,top_k=K,top_p=P,min_p=M`, which parses
    back to the same sampler (saved results name their samplers that way)."""
    raw = str(text).strip()
    if raw.lower() in PRESETS:
        return PRESETS[raw.lower()]
    if "=" not in raw:
        raise _usage(text, "unknown preset")
    values: dict[str, float] = {}
    for part in raw.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not key or not value:
            raise _usage(text, f"{part.strip()!r} is not key=value")
        canon = _KEYS.get(key.lower())
        if canon is None:
            raise _usage(text, f"unknown setting {key!r}")
        if canon in values:
            raise _usage(text, f"{key!r} is given twice")
        try:
            number = float(value)
        except ValueError:
            raise _usage(text, f"{key}={value!r} is not a number") from None
        if not math.isfinite(number):
            raise _usage(text, f"{key}={value} is not a finite number")
        values[canon] = number
    s = {**_OFF, **values}
    if s["temp"] < 0:
        raise _usage(text, f"temp must be >= 0, not {_num(s['temp'])}")
    if s["top_k"] < 0 or s["top_k"] != int(s["top_k"]):
        raise _usage(text, f"top_k must be an integer >= 0, not {s['top_k']:g}")
    for key in ("top_p", "min_p"):
        if not 0.0 <= s[key] <= 1.0:
            raise _usage(text, f"{key} must be between 0 and 1, not {s[key]:g}")
    top_k = int(s["top_k"])
    name = settings_text(s["temp"], top_k, s["top_p"], s["min_p"])
    return Sampler(name=name, temperature=float(s["temp"]), top_k=top_k, top_p=float(s["top_p"]),
                   min_p=float(s["min_p"]))


def settings_text(temp: float, top_k: int, top_p: float, min_p: float) -> str:
    """The canonical settings string (a sampler's name unless it is a preset)."""
    return f"temp={_num(temp)},top_k={int(top_k)},top_p={_num(top_p)},min_p={_num(min_p)}"


def parse_all(specs) -> tuple[Sampler, ...]:
    """Samplers from strings or Sampler values, in the order given, each name once. A Sampler value whose
    name does not parse back to its settings is validated and renamed by its settings string, so every
    name in an output says what was computed."""
    out: dict[str, Sampler] = {}
    for spec in specs or ():
        if isinstance(spec, Sampler):
            try:
                same = parse(spec.name) == spec
            except QevalError:
                same = False
            s = spec if same else parse(spec.settings_name)
        else:
            s = parse(spec)
        out.setdefault(s.name, s)
    return tuple(out.values())


def reads_distribution(specs) -> bool:
    """Whether any of these samplers reads more of a row than its argmax (all but greedy ones): a live
    candidate's rows must then be coded, as the sampler kernel reads codes (metrics.compare_chunk)."""
    return any(not s.greedy for s in parse_all(specs))


def settings_names(specs) -> list[str]:
    """The canonical settings strings of samplers (names, strings or Sampler values): what a comparison
    computed with them measured, whatever names they were asked for by (qeval.identity.ComparisonRequest)."""
    return [s.settings_name for s in parse_all(specs)]


def held_as(samplers: dict, name: str) -> str | None:
    """The name under which a comparison's "samplers" block holds the figures of sampler `name` (the same
    settings, whichever name they were asked for by); None when it holds none."""
    wanted = parse(name).settings()
    return next((held for held, block in (samplers or {}).items() if block.get("settings") == wanted), None)


# --------------------------------------------------------------------------------------------------
# per-token columns
# --------------------------------------------------------------------------------------------------
# Per sampler, these per-token columns sit beside metrics.PER_TOKEN_FIELDS, named "<kind>@<sampler name>".
COLUMN_KINDS = ("tvd", "support_differs", "support_ref", "support_cand")


def column(kind: str, name: str) -> str:
    return f"{kind}@{name}"


def is_column(key: str) -> bool:
    kind, sep, name = key.partition("@")
    return bool(sep) and kind in COLUMN_KINDS and bool(name)


def names_in(per_token) -> list[str]:
    """The samplers whose columns a per-token table holds, in column order."""
    return [key.partition("@")[2] for key in per_token if key.startswith("tvd@")]


# --------------------------------------------------------------------------------------------------
# preparing a set of samplers for one store pair
# --------------------------------------------------------------------------------------------------
# Columns of Prepared.params and of the kernel's output.
P_TOP_K, P_TOP_P, P_LOG_MIN_P, P_TEMP = range(4)
O_TVD, O_DIFFERS, O_N_REF, O_N_CAND = range(4)


@dataclass
class Prepared:
    """What the kernel reads for a tuple of samplers and one pair of code tables. Greedy samplers need
    no kernel (their figures come from the stored argmaxes); `kernel` indexes the others."""

    samplers: tuple[Sampler, ...]
    kernel: list[int]  # indices into samplers of the non-greedy ones, in kernel order
    params: np.ndarray  # float64 [S', 4]: top_k (0 = off), top_p (>= 1 = off), log(min_p) (-inf = off), temp
    tables: np.ndarray  # float64 [4, 65536]: exp(lut_ref), lut_ref, exp(lut_cand), lut_cand
    tempered: np.ndarray  # float64 [2, S', 65536]: exp(lut / t), reference then candidate
    n_start: int  # candidates selected first per row

    def new_output(self, n: int) -> np.ndarray:
        return np.empty((n, len(self.kernel), 4))


def prepare(samplers, lut_ref: np.ndarray, lut_cand: np.ndarray, n_vocab: int) -> Prepared:
    samplers = parse_all(samplers)
    kernel = [i for i, x in enumerate(samplers) if not x.greedy]
    chosen = [samplers[i] for i in kernel]
    luts = [np.asarray(lut, dtype=np.float64) for lut in (lut_ref, lut_cand)]
    tempered = np.empty((2, len(chosen), N_CODES))
    for side, lut64 in enumerate(luts):
        for i, x in enumerate(chosen):
            tempered[side, i] = np.exp(lut64 / x.temperature)
    params = np.array([[x.top_k, x.top_p, math.log(x.min_p) if x.min_p > 0 else -np.inf, x.temperature]
                       for x in chosen], dtype=np.float64).reshape(len(chosen), 4)
    ks = [x.top_k for x in chosen if x.top_k > 0]
    opened = any(x.top_k == 0 and x.truncates for x in chosen)
    n_start = max(ks + ([OPEN_START] if opened else []) + [1])
    tables = np.stack([np.exp(luts[0]), luts[0], np.exp(luts[1]), luts[1]])
    return Prepared(samplers=samplers, kernel=kernel, params=params, tables=tables, tempered=tempered,
                    n_start=min(n_start, n_vocab))


def run_block(prep: Prepared, planes_ref: np.ndarray, planes_cand: np.ndarray, sums: np.ndarray,
              out: np.ndarray) -> None:
    """Kernel figures of a block of rows into `out` [b, S', 4]; `sums` are the rows' kernels.pair_sums."""
    if prep.kernel:
        sampler_rows(np.ascontiguousarray(planes_ref), np.ascontiguousarray(planes_cand), sums, prep.tables,
                     prep.params, prep.tempered, prep.n_start, out)


def chunk_columns(prep: Prepared, out: np.ndarray, argmax_ref: np.ndarray, argmax_cand: np.ndarray) -> dict:
    """The per-token columns of a chunk: kernel output for sampling samplers, argmaxes for greedy ones."""
    cols = {}
    slot = {i: k for k, i in enumerate(prep.kernel)}
    n = len(argmax_ref)
    for i, s in enumerate(prep.samplers):
        if s.greedy:  # a point mass on each side's stored argmax
            differs = np.asarray(argmax_ref) != np.asarray(argmax_cand)
            values = (differs.astype(np.float64), differs, np.ones(n, np.int32), np.ones(n, np.int32))
        else:
            o = out[:, slot[i]]
            values = (o[:, O_TVD].copy(), o[:, O_DIFFERS] != 0, o[:, O_N_REF].astype(np.int32),
                      o[:, O_N_CAND].astype(np.int32))
        for kind, v in zip(COLUMN_KINDS, values):
            cols[column(kind, s.name)] = v
    return cols


# --------------------------------------------------------------------------------------------------
# summary figures (the "samplers" block of a comparison's JSON)
# --------------------------------------------------------------------------------------------------
def summary(per_token) -> dict:
    """{sampler name: figures} for every sampler whose columns `per_token` holds. TVD and agreement
    are fractions (0..1); greedy agreement is the share of tokens with the same argmax (the same for
    every sampler, = same_top1)."""
    out = {}
    same_top1 = per_token.get("same_top1")
    for name in names_in(per_token):
        tvd = np.asarray(per_token[column("tvd", name)], dtype=np.float64)
        m, se = stats.mean_se(tvd)
        differs, differs_se = stats.proportion_se(per_token[column("support_differs", name)])
        block = {
            "settings": parse(name).settings(),
            "tvd": {"mean": m, "se": se, "ladder": stats.ladder(tvd, stats.KLD_LADDER)},
            "agreement": {"mean": 1.0 - m, "se": se},
            "support_differs": {"fraction": differs, "se": differs_se},
            "support": {"ref_mean": float(np.mean(per_token[column("support_ref", name)])),
                        "cand_mean": float(np.mean(per_token[column("support_cand", name)]))},
        }
        if same_top1 is not None:
            g, g_se = stats.proportion_se(same_top1)
            block["greedy_agreement"] = {"fraction": g, "se": g_se}
        out[name] = block
    return out


# --------------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------------
@numba.njit(nogil=True, cache=True, inline="always")
def _worse(c1, i1, c2, i2):  # pragma: no cover - compiled
    """(code c1, id i1) ranks below (c2, i2): a lower code, or the same code and a higher token id."""
    return c1 < c2 or (c1 == c2 and i1 > i2)


@numba.njit(nogil=True, cache=True)
def _sift_down(hc, hid, size, pos):  # pragma: no cover - compiled
    c = hc[pos]
    i = hid[pos]
    while True:
        child = 2 * pos + 1
        if child >= size:
            break
        right = child + 1
        if right < size and _worse(hc[right], hid[right], hc[child], hid[child]):
            child = right
        if _worse(hc[child], hid[child], c, i):
            hc[pos] = hc[child]
            hid[pos] = hid[child]
            pos = child
        else:
            break
    hc[pos] = c
    hid[pos] = i


@numba.njit(nogil=True, cache=True)
def _sift_up(hc, hid, pos):  # pragma: no cover - compiled
    c = hc[pos]
    i = hid[pos]
    while pos > 0:
        parent = (pos - 1) >> 1
        if _worse(c, i, hc[parent], hid[parent]):
            hc[pos] = hc[parent]
            hid[pos] = hid[parent]
            pos = parent
        else:
            break
    hc[pos] = c
    hid[pos] = i


@numba.njit(nogil=True, cache=True)
def _block_or(hi, bor):  # pragma: no cover - compiled
    """bor[j] = OR of the high bytes of entries j*BLOCK ... j*BLOCK+BLOCK-1: at least their maximum, with
    the same top bit. Read 8 bytes at a time (vectorises; a max over bytes does not)."""
    n = hi.shape[0]
    full = n // BLOCK
    words = hi[:full * BLOCK].view(np.uint64)
    per = BLOCK // 8
    for j in range(full):
        acc = np.uint64(0)
        base = j * per
        for k in range(per):
            acc |= words[base + k]
        acc |= acc >> np.uint64(32)
        acc |= acc >> np.uint64(16)
        acc |= acc >> np.uint64(8)
        bor[j] = np.uint8(acc & np.uint64(0xFF))
    if full < bor.shape[0]:
        b = np.uint8(0)
        for i in range(full * BLOCK, n):
            b |= hi[i]
        bor[full] = b


@numba.njit(nogil=True, cache=True)
def _block_order(bor, order):  # pragma: no cover - compiled
    """Block indices by descending `bor` (a counting sort)."""
    counts = np.zeros(256, dtype=np.int32)
    for j in range(bor.shape[0]):
        counts[bor[j]] += 1
    acc = 0
    for v in range(255, -1, -1):
        c = counts[v]
        counts[v] = acc
        acc += c
    for j in range(bor.shape[0]):
        v = bor[j]
        order[counts[v]] = j
        counts[v] += 1


@numba.njit(nogil=True, cache=True)
def _select_top(hi, lo, bor, order, n, hc, hid, out_c, out_i):  # pragma: no cover - compiled
    """The n best entries of a row by (code descending, token id ascending) into out_c/out_i[:n], best
    first; returns how many (n, or the row's length). Blocks are read in descending `bor` order into a
    heap of the n best; once a block's `bor` is below the high byte of the heap's worst code, neither
    it nor any later block holds a better entry."""
    n_vocab = hi.shape[0]
    size = 0
    for r in range(order.shape[0]):
        j = order[r]
        if size == n and np.int32(bor[j]) < (hc[0] >> 8):
            break
        stop = min((j + 1) * BLOCK, n_vocab)
        for i in range(j * BLOCK, stop):
            c = (np.int32(hi[i]) << 8) | np.int32(lo[i])
            if size < n:
                hc[size] = c
                hid[size] = i
                _sift_up(hc, hid, size)
                size += 1
            elif _worse(hc[0], hid[0], c, i):
                hc[0] = c
                hid[0] = i
                _sift_down(hc, hid, n, 0)
    for k in range(size - 1, -1, -1):  # pop the worst into the last free slot: best first
        out_c[k] = hc[0]
        out_i[k] = hid[0]
        hc[0] = hc[k]
        hid[0] = hid[k]
        _sift_down(hc, hid, k, 0)
    return size


@numba.njit(nogil=True, cache=True)
def _support_len(pc, n_have, n_vocab, top_k, top_p, log_min_p, z_full, e, l):  # pragma: no cover - compiled
    """Length of the surviving prefix of the sorted candidates pc[:n_have] (the row's best n_have),
    or -1 when the cut lies beyond them (more candidates are needed)."""
    n = n_vocab if top_k <= 0 else min(top_k, n_vocab)
    lim = min(n, n_have)
    keep = lim
    decided = lim == n
    if top_p < 1.0:
        if top_k > 0 and n > n_have:
            return -1
        if top_k > 0:  # top-p renormalises over the top-k survivors, in their sorted order
            z = 0.0
            for i in range(n):
                z += e[pc[i]]
        else:
            z = z_full
        cum = 0.0
        for i in range(lim):
            cum += e[pc[i]] / z
            if cum >= top_p:
                keep = i + 1
                decided = True
                break
    if log_min_p > -np.inf:
        floor = l[pc[0]] + log_min_p
        for i in range(1, keep):
            if l[pc[i]] < floor:
                keep = i
                decided = True
                break
    return keep if decided else -1


@numba.njit(nogil=True, cache=True)
def _tvd(ids_p, w_p, n_p, ids_q, w_q, n_q):  # pragma: no cover - compiled
    """(½ Σ|p−q| over the union of the supports, whether the supports differ) for two normalised
    distributions given as (token ids, probabilities)."""
    total = 0.0
    matched = 0
    if n_p * n_q <= 4096:
        seen = np.zeros(n_q, dtype=np.bool_)
        for a in range(n_p):
            hit = -1
            for b in range(n_q):
                if ids_q[b] == ids_p[a]:
                    hit = b
                    break
            if hit >= 0:
                seen[hit] = True
                matched += 1
                total += abs(w_p[a] - w_q[hit])
            else:
                total += w_p[a]
        for b in range(n_q):
            if not seen[b]:
                total += w_q[b]
    else:
        op = np.argsort(ids_p[:n_p])
        oq = np.argsort(ids_q[:n_q])
        a = 0
        b = 0
        while a < n_p or b < n_q:
            if b >= n_q or (a < n_p and ids_p[op[a]] < ids_q[oq[b]]):
                total += w_p[op[a]]
                a += 1
            elif a >= n_p or ids_q[oq[b]] < ids_p[op[a]]:
                total += w_q[oq[b]]
                b += 1
            else:
                total += abs(w_p[op[a]] - w_q[oq[b]])
                matched += 1
                a += 1
                b += 1
    tvd = min(max(0.5 * total, 0.0), 1.0)
    return tvd, not (matched == n_p and matched == n_q)


@numba.njit(nogil=True, cache=True)
def _full_tvd(hi_p, lo_p, hi_q, lo_q, et_p, et_q):  # pragma: no cover - compiled
    """TVD of two whole rows reshaped by temperature (a sampler that truncates nothing)."""
    zp = 0.0
    zq = 0.0
    n = hi_p.shape[0]
    for i in range(n):
        zp += et_p[(np.int32(hi_p[i]) << 8) | np.int32(lo_p[i])]
        zq += et_q[(np.int32(hi_q[i]) << 8) | np.int32(lo_q[i])]
    total = 0.0
    for i in range(n):
        total += abs(et_p[(np.int32(hi_p[i]) << 8) | np.int32(lo_p[i])] / zp
                     - et_q[(np.int32(hi_q[i]) << 8) | np.int32(lo_q[i])] / zq)
    return min(max(0.5 * total, 0.0), 1.0)


@numba.njit(nogil=True, cache=True)
def _cuts(params, s):  # pragma: no cover - compiled
    """Whether sampler s truncates at all (top_k, top_p or min_p on)."""
    return params[s, 0] > 0 or params[s, 1] < 1.0 or params[s, 2] > -np.inf


@numba.njit(nogil=True, cache=True)
def _side(hi, lo, bor, order, n_start, z_full, e, l, params, lengths):  # pragma: no cover - compiled
    """One row's candidates, best first, grown until every truncating sampler's cut lies inside them;
    each such sampler's support length goes to `lengths`."""
    n_vocab = hi.shape[0]
    n = n_start
    while True:
        hc = np.empty(n, dtype=np.int32)
        hid = np.empty(n, dtype=np.int32)
        pc = np.empty(n, dtype=np.int32)
        pid = np.empty(n, dtype=np.int32)
        got = _select_top(hi, lo, bor, order, n, hc, hid, pc, pid)
        short = False
        for s in range(params.shape[0]):
            if not _cuts(params, s):
                lengths[s] = n_vocab
                continue
            k = _support_len(pc, got, n_vocab, np.int64(params[s, 0]), params[s, 1], params[s, 2], z_full, e, l)
            short = short or k < 0
            lengths[s] = k
        if not short or n >= n_vocab:
            return pc, pid
        n = min(n_vocab, n * 8)


@numba.njit(nogil=True, cache=True)
def sampler_rows(planes_p, planes_q, sums, tables, params, tempered, n_start, out):  # pragma: no cover - compiled
    """Per row t and (non-greedy) sampler s, out[t, s] = (TVD of the two sampled distributions, 1 if their
    supports differ, support size of the reference, of the candidate).

    planes_*: uint8 [b, 2, V]; sums: [b, 6] kernels.pair_sums of the rows (their total masses
    Σ exp(lut[code]) in columns 0 and 1); tables: [4, 65536] exp(lut_ref), lut_ref, exp(lut_cand),
    lut_cand; params: [S, 4] top_k, top_p, log(min_p), temperature; tempered: [2, S, 65536] exp(lut / t)."""
    n_rows, _, n_vocab = planes_p.shape
    n_s = params.shape[0]
    n_blocks = (n_vocab + BLOCK - 1) // BLOCK
    bor_p = np.empty(n_blocks, dtype=np.uint8)
    bor_q = np.empty(n_blocks, dtype=np.uint8)
    order_p = np.empty(n_blocks, dtype=np.int32)
    order_q = np.empty(n_blocks, dtype=np.int32)
    len_p = np.empty(n_s, dtype=np.int64)
    len_q = np.empty(n_s, dtype=np.int64)
    any_cut = False
    for s in range(n_s):
        any_cut = any_cut or _cuts(params, s)
    e_p = tables[0]
    l_p = tables[1]
    e_q = tables[2]
    l_q = tables[3]
    for t in range(n_rows):
        hi_p = planes_p[t, 0]
        lo_p = planes_p[t, 1]
        hi_q = planes_q[t, 0]
        lo_q = planes_q[t, 1]
        pc = np.empty(0, dtype=np.int32)
        pid = pc
        qc = pc
        qid = pc
        if any_cut:
            _block_or(hi_p, bor_p)
            _block_or(hi_q, bor_q)
            _block_order(bor_p, order_p)
            _block_order(bor_q, order_q)
            pc, pid = _side(hi_p, lo_p, bor_p, order_p, n_start, sums[t, 0], e_p, l_p, params, len_p)
            qc, qid = _side(hi_q, lo_q, bor_q, order_q, n_start, sums[t, 1], e_q, l_q, params, len_q)
        for s in range(n_s):
            if not _cuts(params, s):
                out[t, s, 0] = _full_tvd(hi_p, lo_p, hi_q, lo_q, tempered[0, s], tempered[1, s])
                out[t, s, 1] = 0.0  # every token keeps some probability on both sides
                out[t, s, 2] = n_vocab
                out[t, s, 3] = n_vocab
                continue
            n_p = len_p[s]
            n_q = len_q[s]
            w_p = np.empty(n_p)
            w_q = np.empty(n_q)
            et_p = tempered[0, s]
            et_q = tempered[1, s]
            zp = 0.0
            for i in range(n_p):
                w_p[i] = et_p[pc[i]]
                zp += w_p[i]
            zq = 0.0
            for i in range(n_q):
                w_q[i] = et_q[qc[i]]
                zq += w_q[i]
            for i in range(n_p):
                w_p[i] /= zp
            for i in range(n_q):
                w_q[i] /= zq
            tvd, differs = _tvd(pid, w_p, n_p, qid, w_q, n_q)
            out[t, s, 0] = tvd
            out[t, s, 1] = 1.0 if differs else 0.0
            out[t, s, 2] = n_p
            out[t, s, 3] = n_q
