"""The live status page (`GET /`) and the JSON behind it (`GET /api/status`)."""
