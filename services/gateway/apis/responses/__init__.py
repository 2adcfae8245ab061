"""The Responses API: request body, conversation items, output items and events, stored responses, routes."""
