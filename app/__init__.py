"""kvtier service: settings, wire protocol, server, client, admin HTTP and CLI."""
