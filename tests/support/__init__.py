"""Helpers shared by the tests: fakes, sample messages, reference models, stack and process
helpers, and the modules tests run as processes (`python -m tests.support.<module>`).

The rule: `tests/<area>/` holds `test_*.py` and `conftest.py` (fixtures only); anything a test
module or a conftest imports lives here. No module imports from a `test_*` module or a conftest
(tests/test_layout.py checks it). Tools run by hand or by make (tests/benchmarks, tests/soak,
tests/fuzz/run.py, tests/runtime/whisper_report.py, tests/multihost) import from here too."""
