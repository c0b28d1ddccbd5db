"""The benchmarks: each module a benchmark that writes its JSON, run from the repository root.

``python -m benchmarks.run`` regenerates every result and the report
(``benchmarks/results/REPORT.md``); ``python -m benchmarks.<name>`` runs one
(``cost``, ``traffic``, ``cluster``, ...). They are not part of the
installed library.
"""
