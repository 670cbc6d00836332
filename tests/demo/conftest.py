"""The demo tests read SGLang 0.5.23's source as the fetch tests do."""

from tests.fetch.conftest import sglang_srt  # noqa: F401  (the wheel-source fixture)
