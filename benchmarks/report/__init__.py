"""The benchmark report: ``python -m benchmarks.report`` writes ``REPORT.md`` from the results.

One module per section (`cost`, `traffic`, `scale`, `density`, `memory`,
`cluster`: prose, tables, targets), the figures in `plots`, the shared formats
in `_format`, the assembly in `__main__`.
"""
