//! What the server offers that `run` and `setup` need, read over SQL: `wal_level =
//! logical`, a role with `REPLICATION`, the publication. Checked by `setup`
//! ([`super::provisioning`]) and by `run`'s pre-flight and `status`
//! ([`super::inspection`]).

use tokio_postgres::Client;

use crate::error::Error;

/// Whether a publication of this name exists in the connected database.
///
/// # Errors
/// [`Error::Sql`].
pub async fn publication_exists(client: &Client, publication: &str) -> Result<bool, Error> {
    Ok(client
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .map_err(|e| Error::sql("looking up the publication", e))?
        .is_some())
}

/// Fails unless `wal_level = logical`.
///
/// # Errors
/// [`Error::Precondition`] naming the setting, its value and the fix.
pub async fn check_wal_level(client: &Client) -> Result<(), Error> {
    let row = client
        .query_one("SELECT current_setting('wal_level')", &[])
        .await
        .map_err(|e| Error::sql("reading wal_level", e))?;
    let level: String = row.get(0);
    if level != "logical" {
        return Err(Error::Precondition(format!(
            "wal_level is '{level}'; set wal_level = logical in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL"
        )));
    }
    Ok(())
}

/// Fails unless the current role may use replication.
///
/// # Errors
/// [`Error::Precondition`] with the `ALTER ROLE` to run.
pub async fn check_replication_role(client: &Client) -> Result<(), Error> {
    let row = client
        .query_one(
            "SELECT current_user::text, rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await
        .map_err(|e| Error::sql("reading the role's attributes", e))?;
    let (user, ok): (String, bool) = (row.get(0), row.get(1));
    if !ok {
        return Err(Error::Precondition(format!(
            "role {user:?} lacks the REPLICATION attribute; run ALTER ROLE \"{user}\" REPLICATION as a superuser"
        )));
    }
    Ok(())
}
