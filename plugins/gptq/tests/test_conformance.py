"""The anyquant conformance kit, run on anyquant-gptq."""

from anyquant.testing import PluginConformance


class TestConformance(PluginConformance):
    entry_point = "anyquant-gptq"
    package = "anyquant_gptq"
    formats = ("gptq",)
    own_fixtures = ("gptq_v1", "gptq_v2", "gptq_autogptq")
