"""The anyquant conformance kit, run on anyquant-exl3."""

from anyquant.testing import PluginConformance


class TestConformance(PluginConformance):
    entry_point = "anyquant-exl3"
    package = "anyquant_exl3"
    formats = ("exl3", "exl2")
    own_fixtures = ("exl3_mul1", "exl3_3inst", "exl3_ring_embedding", "exl2")
