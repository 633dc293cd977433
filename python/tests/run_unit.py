#!/usr/bin/env python3
"""Runs the unit tests of ``nccl_ep`` (``test_*.py`` beside this file) and ends with one line,
``N passed, N failed, N skipped``; exits 1 when any failed or errored (plain unittest, nothing to
install)."""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    import nccl_ep

    print("nccl_ep %s from %s; %s" % (nccl_ep.__version__, os.path.dirname(nccl_ep.__file__), nccl_ep.NCCL_EP_LOAD_MESSAGE))
    suite = unittest.defaultTestLoader.discover(HERE, pattern="test_*.py", top_level_dir=HERE)
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    skipped = len(result.skipped)
    passed = result.testsRun - failed - skipped - len(result.expectedFailures)
    for test, reason in result.skipped:
        print("SKIPPED: %s: %s" % (test.id(), reason))
    print("%d passed, %d failed, %d skipped" % (passed, failed, skipped))
    return 1 if failed or result.testsRun == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
