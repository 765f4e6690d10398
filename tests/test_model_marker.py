"""The `model` marker is enforced: the fast loop (`pytest -m "not model"`) can trust
that nothing it runs loads the real model, because conftest.py fails a test that does
without the marker. Checked here on a throwaway test file run by pytest itself."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")


def test_an_unmarked_test_that_loads_the_model_fails(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text(encoding="utf-8"))
    pytester.makepyfile(test_loads="""
        import pytest
        from runner.model_loader import load_model

        def _load():
            try:
                load_model("/nonexistent-model-dir")  # counted even when it fails
            except OSError:
                pass

        def test_unmarked():
            _load()

        @pytest.mark.model
        def test_marked():
            _load()

        def test_no_load():
            pass
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*test_unmarked loaded the real model 1x without "
                                 "@pytest.mark.model*"])
