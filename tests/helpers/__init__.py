"""What several test modules share: tiny models and inputs, reference decoders, test drafters and policies, and the
Ray Serve apps the HTTP tests run against. Test modules import from here, never from each other; fixtures live in the
conftest.py nearest the tests that use them."""
