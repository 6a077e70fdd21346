"""The tools wing: quantize, calibration, evaluate/compare, estimate, advise, export, inspect's report, the lm-eval
adapter, and the staging/publishing helpers they share. Each tool's CLI command lives in ``anyquant.commands``.

The tools build on the contract (``anyquant.api``, ``probe``, ``registry`` ...) and the runtime; the contract does not
import them, except ``api.inspect``, which returns :class:`anyquant.tools.report.Report`.
"""
