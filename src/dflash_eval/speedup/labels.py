"""What the expected speedup is called wherever it is shown: its formula, its tau, and who measured its inputs."""

from __future__ import annotations

FORMULA = "tau_token_weighted x T_AR / (T_draft + T_verify(n))"
TAU_CONVENTION = "token-weighted tau (tokens / verification steps, the bonus token included)"
# the `source` of an estimate, short (summary.csv's speedup_source): who measured the target's and the drafter's step
USER, MEASURED = "user profile", "measured by us"
USER_SGLANG = "user profile (SGLang)"  # a user profile that dflash-eval profile-server measured on their SGLang
SERVER_PROFILE_FORMAT = "dflash-eval server profile 1"  # that file's `format` (tools/profile_server.py writes it)
NO_PROFILE, NO_DRAFT_TIME = "no profile", "no drafter step time"


def source_label(target: str | None, draft: str | None) -> str:
    """USER or MEASURED for each step (None: not known): one label, the same wherever it is shown."""
    if target is None:
        return NO_PROFILE
    if draft is None:
        return NO_DRAFT_TIME
    return target if target == draft else f"{target}; drafter step {draft}"
