import cProfile, pstats, sys
from appliance.filter.service import main
cProfile.run("main(['--config', '/tmp/prof/filter.toml'])", "/tmp/prof/out")
