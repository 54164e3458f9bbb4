"""The operator console (`outbox-relay console`): find, understand and repair failed
events in a browser, with a JSON API for scripts. Needs the `console` extra
(Starlette, Jinja2, uvicorn); the relay daemon itself exposes no web actions."""
