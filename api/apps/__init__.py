"""The apps: the serve and compare ASGI apps and the model loading behind them. The top of api/: only the CLI and the
Ray Serve deployment (scale_out/) import them."""
