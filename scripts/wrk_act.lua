-- wrk script for POST /v1/act: the body comes from QFORGE_BODY (set by scripts/bench_serve.py).
wrk.method = "POST"
wrk.body = os.getenv("QFORGE_BODY")
wrk.headers["Content-Type"] = "application/json"
