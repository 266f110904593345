/*
 * kvplane driver interface, ABI version 1.
 *
 * A driver is a shared library that lets a kvplane backend plugin reach a
 * store whose only client is a vendor's native library (EIC's SDK, for
 * example). The host loads it at run time (dlopen) for plugins whose
 * declaration names it; the plugin keeps the policy (key layout, namespaces,
 * what each status means for a retry) and calls the driver through the
 * contract's `driver` interface. Bytes go straight between the store and
 * host memory: the host passes pointers into its own buffers.
 *
 * Rules every driver follows:
 * - Export one symbol, `kvplane_driver_v1_entry`, returning a pointer to a
 *   static `kvplane_driver_v1` whose `abi_version` is
 *   KVPLANE_DRIVER_ABI_VERSION. The host refuses any other version.
 * - A session is used by one thread at a time; distinct sessions may be used
 *   from distinct threads at once. Calls may block; they should return by
 *   `options->timeout_ms` (0: no deadline) and answer KVPLANE_TIMEOUT for
 *   what they could not finish.
 * - Pointers passed in are valid for the duration of the call only. A driver
 *   never keeps them, never writes outside `dest[i].ptr[0 .. dest[i].len)`,
 *   and never frees them.
 * - Every batch call fills one status per entry (and `detail` where named).
 * - Strings (config keys and values, the namespace) are UTF-8 and
 *   NUL-terminated.
 */
#ifndef KVPLANE_DRIVER_H
#define KVPLANE_DRIVER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVPLANE_DRIVER_ABI_VERSION 1u

/* Per-entry status codes; they map one to one onto the contract's `error`. */
#define KVPLANE_OK 0
#define KVPLANE_NOT_FOUND 1   /* get: no such key; exists: absent */
#define KVPLANE_TIMEOUT 2
#define KVPLANE_UNAVAILABLE 3 /* the store could not be reached */
#define KVPLANE_INVALID 4     /* a malformed key or option */
#define KVPLANE_CAPACITY 5    /* store full; get: value longer than dest */
#define KVPLANE_INTERNAL 6
#define KVPLANE_UNSUPPORTED 7 /* e.g. ttl on a store without expiry */
#define KVPLANE_BUSY 8        /* detail: milliseconds to wait before retrying */
#define KVPLANE_DENIED 9      /* credentials or namespace refused */

/* A read-only byte range. */
typedef struct kvplane_bytes {
    const uint8_t *ptr;
    size_t len;
} kvplane_bytes;

/* A writable byte range owned by the host. */
typedef struct kvplane_mut_bytes {
    uint8_t *ptr;
    size_t len;
} kvplane_mut_bytes;

/* One `config` entry of the plugin's `driver.session.open` call. */
typedef struct kvplane_config_entry {
    const char *key;
    const char *value;
} kvplane_config_entry;

/* Options of one batch call. */
typedef struct kvplane_options {
    /* Time to live of written values in milliseconds; 0: the store's default. */
    uint64_t ttl_ms;
    /* Namespace applied to every key of the call; NULL: the session default. */
    const char *ns;
    /* Milliseconds the call may take; 0: no deadline. */
    uint64_t timeout_ms;
} kvplane_options;

/* A driver's session with its store; opaque to the host. */
typedef struct kvplane_session kvplane_session;

typedef struct kvplane_driver_v1 {
    /* KVPLANE_DRIVER_ABI_VERSION. */
    uint32_t abi_version;
    /* A short name for logs, e.g. "eic". */
    const char *name;
    /* Open a session. On failure return NULL and write a NUL-terminated
     * message (naming the config key at fault, if any) into err[0..err_cap). */
    kvplane_session *(*open)(const kvplane_config_entry *config, size_t n, char *err, size_t err_cap);
    /* Close a session; the host never uses it again. */
    void (*close)(kvplane_session *session);
    /* Store values[i] under keys[i]. */
    void (*put)(kvplane_session *session, const kvplane_bytes *keys, const kvplane_bytes *values, size_t n,
                const kvplane_options *options, int32_t *status, uint64_t *detail);
    /* Copy the value of keys[i] into dest[i]; detail[i] = bytes written. A
     * value longer than dest[i].len is KVPLANE_CAPACITY with detail[i] = its
     * length, and dest[i] may hold garbage. */
    void (*get)(kvplane_session *session, const kvplane_bytes *keys, const kvplane_mut_bytes *dest, size_t n,
                const kvplane_options *options, int32_t *status, uint64_t *detail);
    /* status[i] = KVPLANE_OK when keys[i] is present, KVPLANE_NOT_FOUND when not. */
    void (*exists)(kvplane_session *session, const kvplane_bytes *keys, size_t n, const kvplane_options *options,
                   int32_t *status, uint64_t *detail);
    /* Remove keys[i]; a missing key is KVPLANE_OK. */
    void (*remove)(kvplane_session *session, const kvplane_bytes *keys, size_t n, const kvplane_options *options,
                   int32_t *status, uint64_t *detail);
} kvplane_driver_v1;

/* The one symbol a driver library exports. */
const kvplane_driver_v1 *kvplane_driver_v1_entry(void);

#ifdef __cplusplus
}
#endif

#endif /* KVPLANE_DRIVER_H */
