"""examples/freetoken-no-repeat-ngram, pip-installed, equals transformers' processor."""
from pathlib import Path

from pip_packages import pip_installed
from transformers import NoRepeatNGramLogitsProcessor

from freetoken_core.testing import check_processor

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "freetoken-no-repeat-ngram"


def test_equals_transformers(tmp_path: Path) -> None:
    with pip_installed(EXAMPLE, "freetoken-no-repeat-ngram", "freetoken_no_repeat_ngram", tmp_path):
        check_processor("no_repeat_ngram", [{"no_repeat_ngram_size": n} for n in (1, 2, 3, 4)],
                        lambda f: NoRepeatNGramLogitsProcessor(f["no_repeat_ngram_size"]))
