// The OpenID Provider the single sign-on tests sign in through: node-oidc-provider (a
// certified implementation) with one static client and the users of users.json, each with
// their groups. Usage: node provider.mjs PORT CLIENT_ID CLIENT_SECRET REDIRECT_URI LOGOUT_URI
// Prints "listening" once it serves. Its development login page takes any password.
import { readFileSync } from 'node:fs';
import Provider from 'oidc-provider';

const [port, clientId, clientSecret, redirectUri, logoutUri] = process.argv.slice(2);
const users = JSON.parse(readFileSync(new URL('./users.json', import.meta.url), 'utf8'));
const issuer = `http://127.0.0.1:${port}`;

const provider = new Provider(issuer, {
  clients: [{
    client_id: clientId,
    client_secret: clientSecret,
    redirect_uris: [redirectUri],
    post_logout_redirect_uris: [logoutUri],
    response_types: ['code'],
    grant_types: ['authorization_code'],
    token_endpoint_auth_method: 'client_secret_post',
  }],
  claims: {
    openid: ['sub'],
    email: ['email'],
    profile: ['preferred_username', 'name'],
    groups: ['groups'],
  },
  scopes: ['openid', 'email', 'profile', 'groups'],
  async findAccount(ctx, id) {
    const user = users[id];
    if (!user) return undefined;
    return {
      accountId: id,
      async claims() {
        return { sub: id, preferred_username: user.username ?? id, email: user.email, groups: user.groups };
      },
    };
  },
  features: { devInteractions: { enabled: true }, rpInitiatedLogout: { enabled: true } },
  pkce: { required: () => true },
  cookies: { keys: ['tally-tests-only'] },
});
provider.listen(Number(port), '127.0.0.1', () => console.log('listening'));
