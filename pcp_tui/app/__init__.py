"""What a person runs: the CLI, config files, headless output, the dashboard, the worker's status line.

The app drives the shepherd and the worker; nothing below it imports the app.
"""
