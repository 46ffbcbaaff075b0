"""The HTTP surface: the routes, the server's state, its middleware, metrics and event hub."""
