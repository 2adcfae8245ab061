"""The REST bridge: HTTP/JSON routes and their OpenAPI document from gRPC services' google.api.http annotations."""
