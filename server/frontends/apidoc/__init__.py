"""The API document: `GET /openapi.json` (OpenAPI 3.0, every HTTP route Pier serves) and `GET /docs`
(Swagger UI from the swagger-ui-bundle package: no CDN, works air-gapped)."""
