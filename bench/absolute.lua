-- wrk: send absolute-form requests (what a client sends to a forward proxy) to the proxy
-- given as wrk's URL; the target comes from CORRAL_BENCH_TARGET (empty: a normal request).
local target = os.getenv("CORRAL_BENCH_TARGET")
if target and target ~= "" then
  wrk.path = target
  wrk.headers["Host"] = target:match("^https?://([^/]+)")
end
