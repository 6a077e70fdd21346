"""The anyquant conformance kit, run on anyquant-awq."""

from anyquant.testing import PluginConformance


class TestConformance(PluginConformance):
    entry_point = "anyquant-awq"
    package = "anyquant_awq"
    formats = ("awq",)
    own_fixtures = ("awq_gemm", "awq_gemv")
