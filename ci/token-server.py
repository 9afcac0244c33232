"""A small token server for the token-auth test registry (distribution 2.8 `auth: token`).

Usage (from ci/setup.sh, with the venv's python, which has `cryptography` through moto):
  token-server.py init DIR           make DIR/token.key and DIR/token.crt once (self-signed RSA)
  token-server.py serve DIR PORT     answer GET /token on 127.0.0.1:PORT

Follows the Docker registry token authentication spec (distribution docs, spec/auth/token.md
and spec/auth/jwt.md): `GET /token?service=S&scope=repository:NAME:ACTIONS` answers
`{"token", "access_token", "expires_in", "issued_at"}` with an RS256 JWT whose header names
the signing key by its libtrust key ID (`kid`), which distribution 2.8 matches against the
public keys of the certificates in its `rootcertbundle`.

Anonymous requests get `pull` only; requests with HTTP basic auth as
KILN_TEST_REGISTRY_USER / KILN_TEST_REGISTRY_PASSWORD get what they ask for (push included),
so ci/fixtures.sh can push. A wrong password is answered 401.
"""

import base64
import datetime
import hashlib
import http.server
import json
import os
import sys
import time
import urllib.parse

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

ISSUER = "kiln-test-token-issuer"


def b64url(b):
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def init(d):
    key_path, crt_path = os.path.join(d, "token.key"), os.path.join(d, "token.crt")
    if os.path.exists(key_path) and os.path.exists(crt_path):
        return
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ISSUER)])
    now = int(time.time())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(datetime.datetime.fromtimestamp(now - 86400, datetime.timezone.utc))
        .not_valid_after(datetime.datetime.fromtimestamp(now + 20 * 365 * 86400, datetime.timezone.utc))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    with open(key_path + ".tmp", "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    with open(crt_path + ".tmp", "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    os.rename(key_path + ".tmp", key_path)
    os.rename(crt_path + ".tmp", crt_path)


def libtrust_kid(public_key):
    """libtrust's key ID: base32 of the first 30 bytes of sha256(DER SubjectPublicKeyInfo),
    in 12 groups of 4 characters joined by ':'."""
    der = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    s = base64.b32encode(hashlib.sha256(der).digest()[:30]).decode().rstrip("=")
    return ":".join(s[i : i + 4] for i in range(0, len(s), 4))


def serve(d, port):
    with open(os.path.join(d, "token.key"), "rb") as f:
        key = serialization.load_pem_private_key(f.read(), password=None)
    kid = libtrust_kid(key.public_key())
    user = os.environ.get("KILN_TEST_REGISTRY_USER", "kiln")
    password = os.environ.get("KILN_TEST_REGISTRY_PASSWORD", "kiln-test-password")
    good_basic = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            url = urllib.parse.urlparse(self.path)
            if url.path != "/token":
                self.send_error(404)
                return
            q = urllib.parse.parse_qs(url.query)
            auth = self.headers.get("Authorization")
            if auth is not None and auth != good_basic:
                self.send_error(401)
                return
            access = []
            for scope in q.get("scope", []):
                for one in scope.split(" "):
                    parts = one.split(":")
                    if len(parts) < 3 or parts[0] != "repository":
                        continue
                    name, actions = ":".join(parts[1:-1]), parts[-1].split(",")
                    if auth is None:
                        actions = [a for a in actions if a == "pull"]
                    access.append({"type": "repository", "name": name, "actions": actions})
            now = int(time.time())
            claims = {
                "iss": ISSUER,
                "sub": user if auth else "",
                "aud": q.get("service", [""])[0],
                "exp": now + 300,
                "nbf": now - 10,
                "iat": now,
                "jti": b64url(os.urandom(12)),
                "access": access,
            }
            header = {"typ": "JWT", "alg": "RS256", "kid": kid}
            signing_input = (
                b64url(json.dumps(header).encode()) + "." + b64url(json.dumps(claims).encode())
            )
            sig = key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
            token = signing_input + "." + b64url(sig)
            body = json.dumps(
                {
                    "token": token,
                    "access_token": token,
                    "expires_in": 300,
                    "issued_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    if sys.argv[1] == "init":
        init(sys.argv[2])
    elif sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit("usage: token-server.py init DIR | serve DIR PORT")
