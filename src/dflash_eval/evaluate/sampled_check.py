"""The cache check on sampled completions (T > 0), where argmax agreement alone checks nothing.

A greedy completion is the target's own argmax, so a cache from another model shows as low argmax agreement. A
sampled one leaves the argmax by design, but two facts still bind it to the model that served it:

- **Support** (where the cache holds target log-probs, i.e. the rejection scheme was asked for): every verified
  token was drawn from the target's tempered top-k/top-p distribution, so it lies inside that support on the
  cached logits; outside it only at the filters' tie and rounding edges (docs/sampling_rejection.md). The share of
  read tokens inside it (1 - rejection.outside_support.share_of_tokens) costs nothing more.
- **An argmax floor** (any cache with argmax, when top_k is set): a token drawn from a distribution over at most
  k tokens equals its argmax with probability p(argmax) >= 1/k, so the expected agreement is at least 1/top_k;
  another model's argmax meets the served tokens about 1/V of the time.

`check` flags a share under SUPPORT_FLOOR, or an agreement under half the floor over at least MIN_TOKENS tokens
(the agreement is a mean of dependent per-token events; half the floor leaves room for that).
"""

from __future__ import annotations

SUPPORT_FLOOR = 0.95
MIN_TOKENS = 100


def check(agreement: float | None, seen: int, sampling: list[dict] | None, rejection: dict | None) -> dict | None:
    """diagnostics.sampled_check for sampled completions (None for greedy ones): the support share (None without
    log-probs), the argmax floor (None without top_k), and why the cache is suspect (empty: it is not)."""
    if sampling is None:
        return None
    ks = [int(s.get("top_k", -1)) for s in sampling]
    floor = 1.0 / max(ks) if all(k > 0 for k in ks) else None
    outside = (rejection or {}).get("outside_support")
    support = 1.0 - float(outside["share_of_tokens"]) if outside and outside.get("tokens_read") else None
    suspect = []
    if support is not None and support < SUPPORT_FLOOR:
        suspect.append(
            f"{support:.1%} of the completion tokens read lie inside the cached target's top-k/top-p "
            "support (a served token lies inside it but at the filters' edges)"
        )
    if floor is not None and agreement is not None and seen >= MIN_TOKENS and agreement < floor / 2:
        suspect.append(
            f"argmax agreement {agreement:.1%} is under half of {floor:.1%}, the least a token drawn "
            "under top-k gives the target that served it"
        )
    return {
        "support_share": support,
        "argmax_agreement": agreement,
        "argmax_floor": floor,
        "tokens_seen": seen,
        "suspect": suspect,
    }
