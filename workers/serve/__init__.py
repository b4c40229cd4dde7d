"""The Ray Serve deployments of both pools (`prefill.PrefillWorker`, `decode.DecodeWorker`), the
engine host they share (`worker.EngineWorker`) and the stats board every replica posts to."""
