"""The anyquant conformance kit, run on anyquant-awq."""

from anyquant.testing import PluginConformance


class TestConformance(PluginConformance):
    entry_point = "anyquant-awq"
    package = "anyquant_awq"
    formats = ("awq",)
    own_fixtures = ("awq_gemm", "awq_gemv")
    recognised_only = ("awq",)  # loaders land with the plugin's loading work
