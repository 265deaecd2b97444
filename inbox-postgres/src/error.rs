//! Mapping database errors to the core's typed [`StoreError`], keeping the
//! cause and never a connection string.

use inbox_core::{StoreError, StoreErrorKind};
use sea_orm::sqlx;
use sea_orm::{ConnAcquireErr, DbErr, RuntimeErr};

/// The kind of a PostgreSQL SQLSTATE code.
pub fn kind_of_sqlstate(code: &str) -> StoreErrorKind {
    match code {
        "40001" | "40P01" => StoreErrorKind::Serialization,
        "57014" | "55P03" => StoreErrorKind::Timeout,
        "57P01" | "57P02" | "57P03" => StoreErrorKind::Connection,
        c if c.starts_with("08") => StoreErrorKind::Connection,
        c if c.starts_with("23") => StoreErrorKind::Integrity,
        c if c.starts_with("22") => StoreErrorKind::Data,
        c if c.starts_with("53") || c.starts_with("58") || c.starts_with("XX") => {
            StoreErrorKind::Resource
        }
        _ => StoreErrorKind::Other,
    }
}

fn kind_of_sqlx(e: &sqlx::Error) -> StoreErrorKind {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .map_or(StoreErrorKind::Other, |c| kind_of_sqlstate(&c)),
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::PoolClosed => {
            StoreErrorKind::Connection
        }
        sqlx::Error::PoolTimedOut => StoreErrorKind::Timeout,
        sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => StoreErrorKind::Connection,
        _ => StoreErrorKind::Other,
    }
}

/// Maps a sea-orm error to a [`StoreError`] by the driver's SQLSTATE or
/// error kind, keeping the message as the cause.
pub fn map_db_err(e: &DbErr) -> StoreError {
    let driver = match e {
        DbErr::Conn(RuntimeErr::SqlxError(x))
        | DbErr::Exec(RuntimeErr::SqlxError(x))
        | DbErr::Query(RuntimeErr::SqlxError(x)) => Some(kind_of_sqlx(x)),
        _ => None,
    };
    let kind = match (driver, e) {
        (Some(k), _) if k != StoreErrorKind::Other => k,
        (_, DbErr::ConnectionAcquire(ConnAcquireErr::Timeout)) => StoreErrorKind::Timeout,
        (_, DbErr::ConnectionAcquire(_) | DbErr::Conn(_)) => StoreErrorKind::Connection,
        _ if e.sql_err().is_some() => StoreErrorKind::Integrity,
        _ => StoreErrorKind::Other,
    };
    StoreError::new(kind, e.to_string())
}

/// Maps an error of sqlx itself (statements run on the pool directly) as
/// [`map_db_err`] maps one sea-orm wraps.
pub(crate) fn map_sqlx_err(e: &sqlx::Error) -> StoreError {
    StoreError::new(kind_of_sqlx(e), e.to_string())
}

/// Removes `url` and its password from an error's cause.
pub(crate) fn redact(mut e: StoreError, url: &str) -> StoreError {
    if !url.is_empty() {
        e.cause = e.cause.replace(url, "<database url>");
    }
    if let Some(password) = password_of(url) {
        e.cause = e.cause.replace(password, "<password>");
    }
    e
}

fn password_of(url: &str) -> Option<&str> {
    let rest = url.split_once("://")?.1;
    let userinfo = rest.split_once('@')?.0;
    let password = userinfo.split_once(':')?.1;
    (!password.is_empty()).then_some(password)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates() {
        assert_eq!(kind_of_sqlstate("23505"), StoreErrorKind::Integrity);
        assert_eq!(kind_of_sqlstate("23514"), StoreErrorKind::Integrity);
        assert_eq!(kind_of_sqlstate("22P02"), StoreErrorKind::Data);
        assert_eq!(kind_of_sqlstate("22021"), StoreErrorKind::Data);
        assert_eq!(kind_of_sqlstate("40001"), StoreErrorKind::Serialization);
        assert_eq!(kind_of_sqlstate("40P01"), StoreErrorKind::Serialization);
        assert_eq!(kind_of_sqlstate("57014"), StoreErrorKind::Timeout);
        assert_eq!(kind_of_sqlstate("08006"), StoreErrorKind::Connection);
        assert_eq!(kind_of_sqlstate("57P01"), StoreErrorKind::Connection);
        assert_eq!(kind_of_sqlstate("42P01"), StoreErrorKind::Other);
        // the server's own trouble, not the data's
        assert_eq!(kind_of_sqlstate("53100"), StoreErrorKind::Resource);
        assert_eq!(kind_of_sqlstate("53200"), StoreErrorKind::Resource);
        assert_eq!(kind_of_sqlstate("58030"), StoreErrorKind::Resource);
        assert_eq!(kind_of_sqlstate("XX000"), StoreErrorKind::Resource);
    }

    #[test]
    fn redaction_removes_url_and_password() {
        let url = "postgres://app:s3cret@db:5432/x";
        let e = StoreError::new(
            StoreErrorKind::Connection,
            format!("cannot reach {url}; auth s3cret failed"),
        );
        let r = redact(e, url);
        assert!(!r.cause.contains("s3cret"), "{}", r.cause);
        assert!(!r.cause.contains(url));
        assert_eq!(password_of("postgres://u@h/db"), None);
    }
}
