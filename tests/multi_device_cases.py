"""Cases of the multi-device checks, shared by tests/multi_device_checks.py (which runs them) and
tests/test_multi_device.py (which marks the ones beyond `DEFAULT_` as extended).

Attention variants, hybrid models' window rings and scanned layers on meshes: mode `meshes` runs
the DEFAULT_ cases (the most involved of each), `meshes_more` the rest.
"""

MESHES = ("data=1,model=8", "data=2,model=4", "data=8,model=1")
VARIANTS, DEFAULT_VARIANTS = ("window", "streaming", "mla", "gpt_oss"), ("mla", "gpt_oss")
RINGS = tuple((model, spec) for model in ("gemma3", "gpt_oss") for spec in ("data=2,model=2", "data=2,model=4"))
DEFAULT_RINGS = (("gemma3", "data=2,model=4"),)
SCAN, DEFAULT_SCAN = ("plain", "int8", "int4", "self"), ("self",)
