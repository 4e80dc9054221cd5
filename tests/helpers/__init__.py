"""Helpers shared by test modules (importable as ``helpers.<name>`` since tests/ is on sys.path); no tests here."""
