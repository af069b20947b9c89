"""The name the scheduler plugin is registered under, shared by the plugin and the page (which
finds the plugin by it) without either importing the other; the event topic is control/snapshot.py's."""

PLUGIN = "rollart-dashboard"
