"""The comparison page in a browser: the Selenium driver and the screenshot command."""
