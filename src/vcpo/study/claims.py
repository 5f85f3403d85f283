"""The claims a staleness study tests (VCPO's (a)-(c), VESPO's (d)), each stated with its uncertainty: collapse
counts with Wilson intervals, accuracy differences paired over (warm start, seed) with t intervals, and a
verdict that says whether the difference is larger than the noise.
"""

from __future__ import annotations

from typing import Any

from vcpo.study.stats import Interval, paired_difference, t_interval, wilson_interval

PLAIN_AND_CLIPPED = ("grpo", "tis_seq", "icepop", "m2po", "gspo")
MATCH_TOLERANCE = 0.05
"""Claim (c): "matches synchronous accuracy" when the paired interval of vcpo(k) - vcpo(0) excludes a loss larger
than this (its lower end is above -0.05); "falls short" when the whole interval lies below -0.05."""


def run_key(cell: dict[str, Any]) -> tuple[str, int]:
    """What pairs two cells: the same warm start (its id; the seed's own SFT when unrecorded) and RL seed."""
    return str(cell.get("warm_start") or f"sft-seed{cell['seed']}"), cell["seed"]


def by_run(cells: list[dict[str, Any]], arm: str, k: int, key: str = "late_accuracy") -> dict[Any, float]:
    return {run_key(c): c[key] for c in cells if c["arm"] == arm and c["k"] == k and c.get(key) is not None}


def collapse_count(cells: list[dict[str, Any]]) -> str:
    """``c/n (rate [Wilson 95%])`` of the cells given."""
    n, c = len(cells), sum(cell["collapse_step"] is not None for cell in cells)
    low, high = wilson_interval(c, n)
    return f"{c}/{n} ({c / n if n else 0:.2f} [{low:.2f}, {high:.2f}])"


def _diff(cells: list[dict[str, Any]], arm_a: str, k_a: int, arm_b: str, k_b: int) -> Interval | None:
    return paired_difference(by_run(cells, arm_a, k_a), by_run(cells, arm_b, k_b))


def _beyond(iv: Interval | None) -> str:
    if iv is None:
        return "no shared runs"
    if iv.n == 1:
        return f"{iv}, noise unknown"
    return f"{iv}, {'beyond noise' if iv.excludes_zero() else 'within noise'}"


def claim_a(cells: list[dict[str, Any]], ks: list[int]) -> str:
    arms = [a for a in PLAIN_AND_CLIPPED if any(c["arm"] == a for c in cells)]
    stale = [k for k in ks if k > 0]
    if not arms or 0 not in ks or not stale:
        return ("(a) Plain and clipped objectives collapse as k grows: NOT TESTED (needs a plain or clipped arm at "
                "k = 0 and at some k > 0).")
    k_max = max(stale)
    sync = [c for c in cells if c["arm"] in arms and c["k"] == 0]
    top = [c for c in cells if c["arm"] in arms and c["k"] == k_max]
    n0, c0 = len(sync), sum(c["collapse_step"] is not None for c in sync)
    n1, c1 = len(top), sum(c["collapse_step"] is not None for c in top)
    collapse_beyond = n0 > 0 and n1 > 0 and wilson_interval(c1, n1)[0] > wilson_interval(c0, n0)[1]
    drops = {arm: _diff(cells, arm, k_max, arm, 0) for arm in arms}
    fell = [arm for arm, iv in drops.items() if iv is not None and iv.n > 1 and iv.high < 0]
    verdict = "HELD" if collapse_beyond else "HELD PARTLY (accuracy falls, collapse within noise)" if fell else \
        "NOT SHOWN BEYOND NOISE"
    per_arm = "; ".join(f"{arm}: collapsed {collapse_count([c for c in cells if c['arm'] == arm and c['k'] > 0])} "
                        f"at k > 0, late accuracy k={k_max} minus k=0 {_beyond(drops[arm])}" for arm in arms)
    return (f"(a) Plain and clipped objectives collapse as k grows: {verdict}. Collapsed runs of "
            f"{', '.join(arms)}: {collapse_count(sync)} at k = 0 against {collapse_count(top)} at k = {k_max} "
            f"(separated beyond noise: {'yes' if collapse_beyond else 'no'}, Wilson intervals). "
            f"Accuracy falls beyond noise for: {', '.join(fell) or 'none'}. Per arm: {per_arm}.")


def claim_b(cells: list[dict[str, Any]], detector: dict[str, Any] | None) -> str:
    stale = [c for c in cells if c["k"] > 0 and c.get("mean_ess_ratio") is not None]
    collapsed = [c["mean_ess_ratio"] for c in stale if c["collapse_step"] is not None]
    if not collapsed:
        return "(b) Collapse can be foreseen online from the ESS ratio: NOT TESTED (no stale run collapsed)."
    stable = [c["mean_ess_ratio"] for c in stale if c["collapse_step"] is None]
    ess = (f"mean ESS ratio of collapsed stale runs {t_interval(collapsed)} against {t_interval(stable)} for the "
           "stale runs that did not collapse" if stable else "")
    if detector is None:
        return f"(b) Collapse can be foreseen online from the ESS ratio: NOT SCORED (no held-out split); {ess}."
    best, held = detector["best"], detector["best"]["held_out"]
    verdict = ("NOT SCORED (no held-out run collapsed)" if held["collapsed"] == 0 else
               "HELD" if best["met"] else "DID NOT HOLD")
    low, high = wilson_interval(held["hits"], held["collapsed"])
    return (f"(b) Collapse can be foreseen online (the paper: a sharp ESS fall, an unstable gradient norm): "
            f"{verdict} on the held-out runs for the rule the tuning split ranks first ({best['name']}: "
            f"{best['rule']}; recall {held['hits']}/{held['collapsed']} [Wilson {low:.2f}, {high:.2f}], false alarms "
            f"in {held['false_alarms']} of {held['false_alarms'] + held['quiet']} stable runs; goal: recall >= 0.8 "
            f"and false alarms in < 20%). {ess}.")


def claim_c(cells: list[dict[str, Any]]) -> str:
    stale = sorted({c["k"] for c in cells if c["arm"] == "vcpo" and c["k"] > 0})
    if not any(c["arm"] == "vcpo" and c["k"] == 0 for c in cells) or not stale:
        return ("(c) VCPO stays stable and matches synchronous accuracy up to k = 128: NOT TESTED (needs vcpo runs "
                "at k = 0 and at some k > 0).")
    vcpo = [c for c in cells if c["arm"] == "vcpo" and c["k"] > 0]
    stable = not any(c["collapse_step"] is not None for c in vcpo)
    diffs = {k: _diff(cells, "vcpo", k, "vcpo", 0) for k in stale}
    matched = [k for k, iv in diffs.items() if iv is not None and iv.n > 1 and iv.low >= -MATCH_TOLERANCE]
    short = [k for k, iv in diffs.items() if iv is not None and iv.n > 1 and iv.high < -MATCH_TOLERANCE]
    verdict = ("DID NOT HOLD" if not stable or short else "HELD" if len(matched) == len(stale) else
               "NOT SETTLED (intervals too wide to tell)")
    scope = "" if 128 in stale else " No vcpo run at k = 128."
    detail = "; ".join(f"k={k}: {_beyond(iv)}" for k, iv in diffs.items())
    versus = "; ".join(f"vs {arm} {_beyond(_diff(cells, 'vcpo', max(stale), arm, max(stale)))}"
                       for arm in sorted({c['arm'] for c in cells} - {"vcpo"}))
    return (f"(c) VCPO stays stable and matches synchronous accuracy up to k = 128: {verdict}. vcpo collapsed "
            f"{collapse_count(vcpo)} at k > 0; late accuracy vcpo(k) minus vcpo(0), paired: {detail} (matches: the "
            f"interval's low end >= -{MATCH_TOLERANCE}). At k = {max(stale)}, vcpo minus each arm: {versus}.{scope}")


def claim_d(cells: list[dict[str, Any]]) -> str:
    tested = sorted({c["k"] for c in cells if c["arm"] == "vespo" and 0 < c["k"] <= 64})
    if not tested:
        return "(d) VESPO stays stable up to 64x staleness: NOT TESTED (no vespo run with 0 < k <= 64)."
    runs = [c for c in cells if c["arm"] == "vespo" and 0 < c["k"] <= 64]
    collapsed = any(c["collapse_step"] is not None for c in runs)
    verdict = "DID NOT HOLD" if collapsed else "HELD" if 64 in tested else f"HELD up to k = {max(tested)}"
    detail = "; ".join(f"k={k}: {_beyond(_diff(cells, 'vespo', k, 'vespo', 0))}" for k in tested)
    return (f"(d) VESPO stays stable up to 64x staleness: {verdict} (collapsed {collapse_count(runs)} at "
            f"0 < k <= 64; late accuracy vespo(k) minus vespo(0), paired: {detail}).")


def claims(cells: list[dict[str, Any]], ks: list[int], detector: dict[str, Any] | None) -> list[str]:
    """The four claims, each one line with its verdict and the numbers behind it."""
    return [claim_a(cells, ks), claim_b(cells, detector), claim_c(cells), claim_d(cells)]
