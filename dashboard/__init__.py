"""The live dashboard: a staff page and the WebSocket that feeds it."""
